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

.PHONY: install demo test test-fast bench lint clean

install: $(STAMP)

# torch goes in first (the CPU build from local disk here) so resolving the project never pulls a CUDA build;
# constraints.txt holds the versions the tests (and the golden loss curve) were made with. uv resolves and installs
# the ~230 packages in seconds (pip took ~4 minutes here); pip, which reads pip.conf mirrors, is the fallback.
# curvlinops (the tests' K-FAC reference) and what it imports, without its backpack -> torchvision requirement:
# PyPI's torchvision breaks `transformers` imports beside the CPU torch build (see pyproject.toml).
TEST_ONLY_NO_DEPS := curvlinops-for-pytorch einconv linear_operator opt_einsum
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip uv
	$(PY) -m pip install -q "$(TORCH)"
	$(VENV)/bin/uv pip install -q --python $(PY) -c constraints.txt -e ".[dev]" \
	  || $(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	$(VENV)/bin/uv pip install -q --python $(PY) --no-deps -c constraints.txt $(TEST_ONLY_NO_DEPS) \
	  || $(PY) -m pip install -q --no-deps -c constraints.txt $(TEST_ONLY_NO_DEPS)
	touch $(STAMP)

demo: install
	$(VENV)/bin/lmforge model summary demo
	$(VENV)/bin/lmforge pipeline demo --dpo --distill --compress

# The two-node Ray cluster test runs last, in its own process (it needs the machine's CPUs to itself). The slowest
# tests are listed at the end of each run, so a CI log says where the time went.
test: install
	$(PY) -m pytest -q --durations=15 tests --deselect tests/integration/test_ray_cluster.py
	$(PY) -m pytest -q --durations=5 tests/integration/test_ray_cluster.py

test-fast: install
	$(PY) -m pytest -q tests -m "not slow"

bench: install
	@for script in $(wildcard benchmarks/*.py); do $(PY) $$script || exit 1; done  # one JSON line each

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf outputs .pytest_cache .ruff_cache
