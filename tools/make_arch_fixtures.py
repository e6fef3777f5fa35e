"""Make the architecture fixtures of tests/test_architectures.py: tiny Hugging Face checkpoints with random weights,
each with an architecture's special features switched on, and transformers' float32 answers on them.

For every case below, transformers builds the model from its config with a fixed seed (2 layers, grouped-query
attention, a vocabulary of 320 with a 257-token byte-level tokenizer), the weights are rounded to bfloat16 and
saved as the checkpoint (`save_pretrained`), and the float32 forward of exactly those weights records, on 3 prompts
of 320 token ids:

- the logits at a few positions (float32: the tests compare to 1e-3 relative error), chosen on both sides of the
  boundaries the features have (the llama3 factors' original context, the sliding window);
- the top-1 token at every position (teacher-forced agreement of the Q8_0 conversion);
- the 64 tokens greedy decoding continues each prompt with.

Written to tests/data/arch/CASE/ (config, tokenizer, model.safetensors, reference.npz): a few hundred kB each,
so `make test` converts and runs them without torch. Needs the `fixtures` extra, never the runtime:

    python -m venv /tmp/fixvenv && /tmp/fixvenv/bin/pip install -e '.[fixtures]'
    /tmp/fixvenv/bin/python tools/make_arch_fixtures.py [CASE ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "arch"
PROMPTS, PROMPT_LEN, GREEDY = 3, 320, 64
# Token ids 0-255: bytes; then a few merges (localllm's BPE needs some); then <|endoftext|>; the rest of the 320
# embedding rows: padding (the converter names them [PADn]). Prompts are bytes.
MERGES = ["Ġ t", "Ġ a", "h e", "i n", "r e", "o n", "Ġt he", "e r", "Ġ s", "a t"]
VOCAB, N_BYTES = 320, 256
EOS = N_BYTES + len(MERGES)
# Positions whose full logits are kept: the start, both sides of 16/64 (the llama3 case's bands), of the sliding
# window (48), and the far end (past every band).
POSITIONS = [0, 1, 2, 15, 16, 17, 31, 32, 47, 48, 49, 63, 64, 65, 96, 127, 128, 160, 200, 255, 256, 290, 310, 319]

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5, initializer_range=0.02,
              bos_token_id=EOS, eos_token_id=EOS, pad_token_id=None)

# Weights: transformers' own initialisation (normal, std 0.02), norms drawn from [0.5, 1.5), and, without QK-norm,
# Q and K projections times QK_SCALE so attention is sharp: the positions (RoPE, the window) then matter to the
# logits (a model without its feature is off by 9% to 60% past position 100, not 1%), while the rest stays mild
# enough that Q8_0 keeps 99% of the top-1 tokens (weights quantized alone, in torch). A std of 0.15 throughout
# made the model chaotic: 93% at Q8_0.
QK_SCALE = 4.0
# An untied output head's rows are scaled by exp(N(0, ROW_SPREAD)): as in trained models, some tokens are likelier
# than others. With rows all alike, 2-3% of a random model's top-1 tokens are near-ties within Q8_0's noise
# (97.3-98.1% agreement, weights and activations quantized in torch); with the spread, 98.8-99.2%. Tied models
# predict their input token by a wide margin already (100%).
ROW_SPREAD = 1.0

# Llama and Mistral: 2 query heads over 1 KV head of 32 (a q8_0 KV cache needs head sizes that are multiples of
# 32; hidden / heads as in the real models).
LLAMA_HEADS = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32)

# Embedding std per case where transformers' 0.02 makes a degenerate model: gemma2 scales embeddings by
# sqrt(64) = 8 and its sandwich norms bring each block's output to about unit size, so at 0.02 the token's own
# embedding (RMS 0.16) drowns in the residual and the tied head's top-1 margins are tiny (median 0.06: Q8_0 kept
# 95% of the top-1 tokens); at 0.25, median 1.8.
EMBED_STD = {"gemma2": 0.25}

# name -> (transformers class, config changes, seed)
CASES = {
    # Llama 3.1's RoPE: original context 64, so of the 16 frequencies, the 11 of wavelengths above 64 positions
    # are divided by 8, the 3 between 16 and 64 interpolated, 2 kept; the converter writes them as
    # rope_freqs.weight. Untied output.
    "llama3": ("LlamaForCausalLM", dict(LLAMA_HEADS, tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), 1),
    # Linear RoPE scaling (factor 4), tied output.
    "llama-linear": ("LlamaForCausalLM", dict(LLAMA_HEADS, tie_word_embeddings=True, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}), 2),
    # YaRN (factor 4 from an original context of 64): pairs mixed between scaled and unscaled along the ramp,
    # cos/sin scaled by 1 + 0.1 ln 4.
    "llama-yarn": ("LlamaForCausalLM", dict(LLAMA_HEADS, tie_word_embeddings=False, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}), 6),
    # Mistral with a sliding window of 48 on every layer: most of each 320-token prompt is outside it.
    "mistral-swa": ("MistralForCausalLM", dict(LLAMA_HEADS, sliding_window=48, tie_word_embeddings=False,
                                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), 3),
    # Qwen3: QK-norm, no biases, a head size (32) that is not hidden / heads (16); tied and untied output.
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), 4),
    "qwen3-untied": ("Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False,
                                              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), 5),
    # Gemma 2: both soft-caps small enough to bend the scores and logits (without the attention cap the logits
    # move by 132%, without the final cap by 74%, without the window by 123%), a window of 48 on
    # layer 0 (every other layer from the first), sandwich norms, GeGLU, heads of 32 (query_pre_attn_scalar 32,
    # as llama.cpp scales them), tied output.
    "gemma2": ("Gemma2ForCausalLM", dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=48,
                                         tie_word_embeddings=True, **{"attn_logit_softcapping": 1.0,
                                                                      "final_logit_softcapping": 16.0},
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), 7),
    # SmolLM3: 4 layers, the fourth without RoPE (NoPE), tied output.
    "smollm3": ("SmolLM3ForCausalLM", dict(LLAMA_HEADS, num_hidden_layers=4, tie_word_embeddings=True,
                                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), 8),
    # Qwen3-MoE: 8 experts of width 64 on every layer, top-2 with the two weights renormalised (norm_topk_prob),
    # QK-norm, untied output.
    "qwen3moe": ("Qwen3MoeForCausalLM", dict(head_dim=32, tie_word_embeddings=False, num_experts=8,
                                             num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), 7),
}
# The MoE router's weights times this: transformers' std of 0.02 leaves the experts' logits within ~0.2 of each
# other, so the top-2 would be near-ties that Q8_0's noise flips; sharper, each token's choice is clear.
ROUTER_SCALE = 4.0

# Phi-3 (Phi3ForCausalLM: Phi-3, Phi-3.5, Phi-4-mini): Q/K/V fused in qkv_proj and gate/up in gate_up_proj (always);
# partial rotary (0.75: 24 of each head's 32 dimensions, as Phi-4-mini's 96 of 128); LongRoPE factors that differ
# from 1 (short 1..3, long 1..24 over the 12 frequencies) with cos/sin scaled by sqrt(1 + ln 8 / ln 512) = 1.155
# (max_position_embeddings 4096 over an original context of 512). The original context is above the 320 + 64
# tokens of the prompts and the tests' context of 512, so transformers (by sequence length) and llama.cpp and
# localllm (by context) all use the short factors; LONG_CONTEXT records a prompt longer than the original context,
# where all use the long ones.
PHI3_FACTORS = 12
CASES["phi3"] = ("Phi3ForCausalLM", dict(
    LLAMA_HEADS, head_dim=None, tie_word_embeddings=False, max_position_embeddings=4096,
    original_max_position_embeddings=512, sliding_window=None, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "short_factor": np.geomspace(1.0, 3.0, PHI3_FACTORS).round(4).tolist(),
        "long_factor": np.geomspace(1.0, 24.0, PHI3_FACTORS).round(4).tolist()}), 7)
# case -> length of a prompt past the original context (its logits recorded at LONG_POSITIONS).
LONG_CONTEXT = {"phi3": 600}
LONG_POSITIONS = [0, 100, 320, 511, 512, 513, 560, 599]
# tokenizer_config.json's tokenizer_class where the converter reads it (Phi3MiniModel.set_vocab: byte-level BPE
# for GPT2Tokenizer, as Phi-4-mini's).
TOKENIZER_CLASS = {"phi3": "GPT2Tokenizer"}


def byte_vocab() -> list[str]:
    """GPT-2's byte-to-unicode table: the 256 single-byte tokens of a byte-level BPE vocabulary."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def tokenizer_json() -> dict:
    """A byte-level BPE tokenizer.json of the 256 bytes, a few merges and <|endoftext|>, GPT-2's pre-tokenizer."""
    vocab = byte_vocab() + [m.replace(" ", "") for m in MERGES]
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": EOS, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(vocab)}, "merges": [m.split(" ") for m in MERGES]},
    }


TOKENIZER_CONFIG = {"backend": "tokenizers", "bos_token": None, "eos_token": "<|endoftext|>",
                    "pad_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast",
                    "model_max_length": 2048}


def make_case(name: str) -> None:
    import torch
    import transformers

    cls_name, changes, seed = CASES[name]
    cls = getattr(transformers, cls_name)
    changes = {k: v for k, v in changes.items() if v is not None or k != "head_dim"}  # head_dim None: hidden/heads
    config = cls.config_class(**{**COMMON, **changes})
    config.architectures = [cls_name]
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for pname, p in model.named_parameters():
            if "norm" in pname:  # norms away from 1, so a norm read wrongly shows
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            if not hasattr(model.model.layers[0].self_attn, "q_norm") and pname.endswith(("q_proj.weight",
                                                                                          "k_proj.weight")):
                p.mul_(QK_SCALE)
            if pname.endswith("qkv_proj.weight"):  # fused (phi3): its Q and K rows
                head_dim = config.hidden_size // config.num_attention_heads
                p[: (config.num_attention_heads + config.num_key_value_heads) * head_dim].mul_(QK_SCALE)
            if pname.endswith("mlp.gate.weight"):  # a mixture of experts' router
                p.mul_(ROUTER_SCALE)
        if name in EMBED_STD:
            model.model.embed_tokens.weight.mul_(EMBED_STD[name] / config.initializer_range)
        if not config.tie_word_embeddings:
            model.lm_head.weight.mul_(torch.exp(ROW_SPREAD * torch.randn(config.vocab_size, 1, generator=gen)))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None

    out = OUT / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model.to(torch.bfloat16).save_pretrained(out)
    # The reference is the saved checkpoint loaded in float32 (its bf16 weights widened exactly). Not the model
    # above cast back: that would also round RoPE's inv_freq buffer to bf16 (0.4% off).
    model = cls.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json(), ensure_ascii=False), encoding="utf-8")
    tokenizer_config = dict(TOKENIZER_CONFIG)
    if name in TOKENIZER_CLASS:
        tokenizer_config["tokenizer_class"] = TOKENIZER_CLASS[name]
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))

    rng = np.random.default_rng(100 + seed)
    prompts = rng.integers(0, N_BYTES, (PROMPTS, PROMPT_LEN)).astype(np.int64)
    logits, argmax, greedy, margin = [], [], [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor(p[None])
            full = model(ids).logits[0].float().numpy()
            top2 = np.sort(full, axis=-1)[:, -2:]
            logits.append(full[POSITIONS])
            argmax.append(full.argmax(-1))
            margin.append(top2[:, 1] - top2[:, 0])
            g = model.generate(ids, do_sample=False, max_new_tokens=GREEDY, min_new_tokens=GREEDY)
            greedy.append(g[0, PROMPT_LEN:].numpy())
    extra = {}
    if name in LONG_CONTEXT:  # one prompt past the original context: the long factors' regime
        long_prompt = rng.integers(0, N_BYTES, LONG_CONTEXT[name]).astype(np.int64)
        with torch.no_grad():
            full = model(torch.tensor(long_prompt[None])).logits[0].float().numpy()
        extra = dict(long_prompt=long_prompt.astype(np.int32), long_positions=np.array(LONG_POSITIONS),
                     long_logits=full[LONG_POSITIONS].astype(np.float32))
    np.savez_compressed(out / "reference.npz", prompts=prompts.astype(np.int32), positions=np.array(POSITIONS),
                        logits=np.array(logits, np.float32), argmax=np.array(argmax, np.int32),
                        greedy=np.array(greedy, np.int32), **extra)
    (out / "reference.json").write_text(json.dumps({
        "case": name, "class": cls_name, "seed": seed, "transformers": transformers.__version__,
        "torch": torch.__version__, "prompts": PROMPTS, "prompt_length": PROMPT_LEN, "greedy_tokens": GREEDY,
        "smallest_top1_margin": float(np.min(margin)), "median_top1_margin": float(np.median(margin)),
    }, indent=2) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{name}: {size / 1024:.0f} kB, top-1 margin min {np.min(margin):.4f} median {np.median(margin):.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="*", choices=[[], *CASES], help="cases to make (default: all)")
    args = ap.parse_args(argv)
    for name in args.cases or CASES:
        make_case(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
