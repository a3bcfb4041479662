# dgstream's front door. `make demo` and `make test` each do their own setup.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Re-run the install only when the dependency list changes.
STAMP := $(VENV)/.setup-stamp
VLLM_STAMP := $(VENV)/.setup-vllm-stamp
EVENTS ?= 24

.PHONY: setup setup-vllm kafka-jars test test-fast lint format demo bench mutation clean

setup: $(STAMP) kafka-jars

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	@touch $@

# vLLM 0.33 (its request validation is checked in the tests; several GB of wheels).
setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,vllm]'
	@touch $@ $(STAMP)

# Apache Kafka's jars from Maven Central into .cache/ (outside git), the pinned list of
# infra/kafka/jars.lock.json with its checksums (no Maven); a no-op when present.
kafka-jars:
	@test -x $(BIN)/python || $(MAKE) --no-print-directory setup
	$(BIN)/python -m dgstream.infra.kafka.broker fetch

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The whole suite: lint, types, unit, the real broker, real Ray, vLLM's own validation, in
# a random order (pytest-randomly; the header prints the seed, `--randomly-seed=N` replays
# it; `make test SEED=N` too). The gpu tests (tests/workers/engine/test_vllm_gpu.py) run on
# the GPU machine (bench/gpu_round.sh): here they could only skip.
SEED ?=
PYTEST_ARGS := -p randomly --ignore=tests/workers/engine/test_vllm_gpu.py $(if $(SEED),--randomly-seed=$(SEED))
test: setup-vllm kafka-jars lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Without the vLLM install (quicker inner loop).
test-fast: setup lint
	$(BIN)/python -m pytest $(PYTEST_ARGS) -m "not vllm"

# Mutation testing of the modules in pyproject's [tool.mutmut] (not in CI: about an hour on
# 2 cores). One mutmut worker at nice 10 and one thread per test process: the machine is
# shared. The tiny model is built once for the run, into mutants/. Then the score per module
# goes to docs/benchmarks.md, and the survivors not explained in docs/mutation.md are listed
# (bench/mutation_score.py).
mutation: setup
	rm -rf mutants
	mkdir -p mutants/.model-cache
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 DGSTREAM_TEST_CACHE_DIR=$(CURDIR)/mutants/.model-cache \
	  nice -n 10 $(BIN)/python -m bench.mutmut_run run --max-children 1
	$(BIN)/python -m bench.mutation_score --write

demo: setup
	$(BIN)/dgstream demo --events $(EVENTS)

# Rewrites the worker-overhead section of docs/benchmarks.md with this machine's figures
# (a checkout's benchmark: it starts the checkout's broker and writes the checkout's docs).
bench: setup
	$(BIN)/python bench/worker_overhead.py

clean:
	-$(BIN)/dgstream broker stop --delete-data
	rm -rf .cache .mypy_cache .ruff_cache .pytest_cache
