# Two commands on a fresh machine: `make run` (the main job, embedded default) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.gyre-installed
ARGS ?=
# `make run` asks for a held-out eval every 6 steps (docs/evaluation.md; under elastic mid-run ones may be
# abandoned); EVAL= turns it off
EVAL ?= eval.every=6
PYTEST_ARGS ?=
# processes the unit tier runs over (pytest-xdist); each imports the whole suite: 0.55 GiB before its first test
TEST_WORKERS ?= 2

.PHONY: run test setup lint format clean

run: $(STAMP)
	$(PY) -m launch.run $(EVAL) $(ARGS)

# The whole suite: the unit tier over TEST_WORKERS processes, then the other tiers in one process, as each
# end-to-end run starts a job of several processes that needs the machine's CPUs; with PYTEST_ARGS, one pytest
test: $(STAMP)
ifeq ($(strip $(PYTEST_ARGS)),)
	$(PY) -m pytest -m "unit and not gpu" -n $(TEST_WORKERS)
	$(PY) -m pytest -m "not unit and not gpu" --durations=40
else
	$(PY) -m pytest -m "not gpu" --durations=40 $(PYTEST_ARGS)
endif

setup: $(STAMP)

$(STAMP): pyproject.toml tools/setup_env.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash tools/setup_env.sh
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check gyre launch tools tests
	$(VENV)/bin/ruff format --check gyre launch tools tests

format: $(STAMP)
	$(VENV)/bin/ruff format gyre launch tools tests

clean:
	rm -rf outputs multirun .pytest_cache .ruff_cache
