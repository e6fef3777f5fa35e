# The two commands of the README: `make chat` and `make test`. Everything else is what they stand on.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The models the test suite runs on (catalog names; see models/).
TEST_MODELS := smollm2-135m-instruct gemma3-270m qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct

.PHONY: setup setup-dev chat test test-models test-clients clients bench bench-large clean

# What running models needs (make chat); the tests' tools come with setup-dev (make test): the official API
# clients, and the OpenCL checkers (Oclgrind, Intel's CPU runtime: 850 MB that a chat user does not need).
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e .
	touch $@

setup-dev: $(VENV)/.installed-dev

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	# pip leaves intel-opencl-rt's .icd naming a conda placeholder path: point pyopencl's loader at the library
	$(BIN)/python -m localllm.kernels.opencl.device --register
	touch $@

# The default model (models/*.toml's `default`), chosen by measurement (README, "Answers that end")
chat: setup
	$(BIN)/localllm pull qwen2.5-coder-1.5b-instruct
	$(BIN)/localllm chat qwen2.5-coder-1.5b-instruct

test-models: setup
	$(BIN)/localllm pull $(TEST_MODELS)

# Two pytest workers, one test file each at a time (--dist loadfile: a file's module fixtures load its models
# once): on 2 cores 15:49 against 20:32 in one process, from an empty kernel cache (Numba compiles on one
# thread, and the server and client tests wait on sockets). TEST_JOBS=1 runs them in one process.
TEST_JOBS ?= 2

test: setup-dev test-models
	$(BIN)/python -m pytest -q --durations=15 $(if $(filter 1,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadfile) -m "not clients"

# The real clients (tests/test_real_clients.py): Claude Code and Codex CLI from npm, aider, llm, LangChain,
# pydantic-ai and instructor from PyPI, pinned in tests/clients/, installed under .clients/ apart from the
# project's environment (aider in one of its own: it pins most of what it uses). .ci/run runs them after `make test`.
CLIENTS ?= .clients

clients: $(CLIENTS)/.installed

$(CLIENTS)/.installed: tests/clients/package.json tests/clients/requirements.txt tests/clients/requirements-aider.txt
	rm -rf $(CLIENTS) && mkdir -p $(CLIENTS)/npm
	cp tests/clients/package.json $(CLIENTS)/npm/
	cd $(CLIENTS)/npm && npm install --no-audit --no-fund --loglevel=error
	$(PYTHON) -m venv $(CLIENTS)/py
	$(CLIENTS)/py/bin/python -m pip install --quiet -r tests/clients/requirements.txt
	$(PYTHON) -m venv $(CLIENTS)/aider
	$(CLIENTS)/aider/bin/python -m pip install --quiet -r tests/clients/requirements-aider.txt
	touch $@

test-clients: setup-dev test-models clients
	LOCALLLM_CLIENTS=$(abspath $(CLIENTS)) $(BIN)/python -m pytest -q --durations=15 -m clients

# LLAMA_BENCH=/path/to/llama-bench: llama.cpp's figures beside localllm's, as ratios from the same run.
# The three large shapes (Llama-3.2-3B, Llama-3.1-8B, Qwen2.5-7B as Q4_K_M with random weights: 11.6 GB, made once
# by tools/make_large_bench_models.py into LARGE_MODELS) after the catalog's.
LARGE_MODELS ?= $(HOME)/.cache/localllm/bench-models
LARGE_SHAPES := llama-3.2-3b llama-3.1-8b qwen2.5-7b

bench: setup
	$(BIN)/localllm bench --present --depth 4096 $(if $(LLAMA_BENCH),--llama-bench $(LLAMA_BENCH))
	$(MAKE) --no-print-directory bench-large

bench-large: setup
	$(BIN)/python tools/make_large_bench_models.py $(LARGE_MODELS) $(LARGE_SHAPES)
	$(BIN)/localllm bench $(foreach m,$(LARGE_SHAPES),$(LARGE_MODELS)/$(m)-q4_k_m.gguf) --depth 4096 \
		$(if $(LLAMA_BENCH),--llama-bench $(LLAMA_BENCH))

clean:
	rm -rf $(VENV) $(CLIENTS) build *.egg-info
