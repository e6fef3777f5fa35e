"""The type names the command line offers (`localllm quantize TYPE`, `localllm convert --type T`), apart from the
modules that implement them: building the argument parser, which every command does, imported localllm.convert.quantize_gguf
(gguf-py) and localllm.convert for these lists, 12 ms of a 0.5 s `localllm run`. localllm/convert/quantize_gguf.py and
localllm/convert/converter.py take their names from here; tests/test_cli.py checks that their tables agree."""

# llama-quantize's QUANT_OPTIONS restricted to the formats of our table (localllm.convert.quantize_gguf.FILE_TYPES)
FILE_TYPE_NAMES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q2_K_S", "Q3_K_S",
                   "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K")
ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}  # as llama-quantize
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# convert --type: convert_hf_to_gguf.py's --outtype (localllm.convert.OUTPUT_TYPES), then a quantize mix
CONVERT_OUTPUT_TYPES = ("f32", "f16", "bf16", "q8_0")
QUANTIZE_MIXES = ("q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m",
                  "q5_k_s", "q5_k_m", "q6_k")
CONVERT_TYPE_CHOICES = ("auto", *CONVERT_OUTPUT_TYPES, *QUANTIZE_MIXES)
