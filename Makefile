# lmforge: `make demo` runs the main job, `make test` runs every test. Both install first if needed.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
# One torch/OMP thread per process: on small CPU machines oversubscription costs 2-4x (shared/notes/performance.md).
export OMP_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1
export DS_ACCELERATOR ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
export PYTHONUNBUFFERED := 1

.PHONY: install bytecode demo test test-fast bench lint clean

install: $(STAMP)

# torch goes in first (the CPU build from local disk here: uv installs a wheel found in $PIP_FIND_LINKS in ~3 s, pip
# took ~24 s) so resolving the project never pulls a CUDA build;
# constraints.txt holds the versions the tests (and the golden loss curve) were made with. uv resolves and installs
# the ~230 packages in seconds (pip took ~4 minutes here); pip, which reads pip.conf mirrors, is the fallback.
# Bytecode: where PYTHONDONTWRITEBYTECODE is set (it is on our machines), Python never writes .pyc files, and every
# process (each `lmforge` launch, each Ray worker) compiled the ~15 s of source it imports again; it still reads .pyc
# files that exist. torch's wheel is installed with its bytecode (3 s: every process imports ~1,200 of its modules;
# without it `lmforge pretrain` spent 3.2 s of its 13.7 compiling them, and each Ray worker again). The other ~230
# packages are not (compiling all of them took 28 s of the 40 s install, mostly modules nothing imports: the
# transformers models other than Llama, Ray's RLlib, moto's services): the make targets below let Python write the
# bytecode of each module the first time any process imports it. `bytecode` compiles lmforge's own code.
export PYTHONDONTWRITEBYTECODE :=
# curvlinops (the tests' K-FAC reference) and what it imports, without its backpack -> torchvision requirement:
# PyPI's torchvision breaks `transformers` imports beside the CPU torch build (see pyproject.toml).
TEST_ONLY_NO_DEPS := curvlinops-for-pytorch einconv linear_operator opt_einsum
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip uv
	$(if $(PIP_FIND_LINKS),$(VENV)/bin/uv pip install -q --python $(PY) --no-index --no-deps --compile-bytecode $(foreach dir,$(PIP_FIND_LINKS),--find-links $(dir)) "$(TORCH)" ||) \
	  $(PY) -m pip install -q "$(TORCH)"
	$(VENV)/bin/uv pip install -q --python $(PY) -c constraints.txt -e ".[dev]" \
	  || $(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	$(VENV)/bin/uv pip install -q --python $(PY) --no-deps -c constraints.txt $(TEST_ONLY_NO_DEPS) \
	  || $(PY) -m pip install -q --no-deps -c constraints.txt $(TEST_ONLY_NO_DEPS)
	touch $(STAMP)

# lmforge's own modules compiled (a few seconds the first time, nothing when up to date), see `install`
bytecode: install
	$(PY) -m compileall -q flows training data_pipeline evaluation infra tests benchmarks >/dev/null

demo: bytecode
	$(VENV)/bin/lmforge model summary demo
	$(VENV)/bin/lmforge pipeline demo --dpo --distill --compress --rl

# Tests run in a random order (pytest-random-order: modules shuffled, and the tests inside each; the seed is printed
# first and SEED=N repeats it), so no test can lean on another's leftovers. `make test-fast` (unit, parity, fast
# integration: what to run before each commit) spreads its in-process tests over TEST_WORKERS xdist workers, a
# module per worker (~45 s less than one process here: they wait on files and subprocesses too). `make test` runs
# those the same way, then the slow suite in one process: run side by side on xdist workers, its multi-process
# tests (pipelines, Ray, servers) were 2-4x slower here; on an AMD EPYC with two real cores too (2026-12-06: 1,095 s
# on two workers against 835 s in one process; the e2e pipeline fixture 145 -> ~400 s, built by both workers). The
# two-node Ray cluster test runs last, in its own process (it needs the machine's CPUs to itself). The slowest tests
# and the time per directory end each run.
TEST_WORKERS ?= 2
SEED ?= $(shell od -An -N2 -tu2 /dev/urandom | tr -d ' ')
PYTEST := $(PY) -m pytest -q -p random_order --random-order-bucket=module --random-order-seed=$(SEED)
FAST := $(PYTEST) -n $(TEST_WORKERS) --dist loadgroup tests -m "not slow"
test: bytecode
	$(FAST) --durations=5
	$(PYTEST) --durations=15 tests -m slow --deselect tests/integration/test_ray_cluster.py
	$(PYTEST) --durations=5 tests/integration/test_ray_cluster.py

test-fast: bytecode
	$(FAST)

bench: install
	@for script in $(wildcard benchmarks/*.py); do $(PY) $$script || exit 1; done  # one JSON line each

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf outputs .pytest_cache .ruff_cache
