# Set-up and entry points. `make demo` and `make test` each build the environment first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU-only machines get the CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
export OMPI_ALLOW_RUN_AS_ROOT ?= 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM ?= 1
MPIRUN := $(BIN)/mpirun -np 2 --oversubscribe --bind-to none

.PHONY: setup demo test test-slow lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[test,bench]"
	touch $@

demo: setup
	$(MPIRUN) $(BIN)/hetero-run doctor

test: setup
	$(BIN)/pytest -q

test-slow: setup
	$(BIN)/pytest -q -m slow --run-slow

lint: setup
	$(BIN)/python -m pip install --quiet ruff
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
