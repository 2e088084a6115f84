# Two entry points: `make demo` (the main job) and `make test`. Both set up .venv first.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-slow test-all clean

setup:
	@bash scripts/setup_venv.sh

demo: setup
	$(PY) -m skyrl_mega.cli demo

test: setup
	$(PY) -m pytest -q -m "not slow and not gpu" --durations=40

# the slow CPU tests (failure recovery, resume, two-node SLURM, memory-capped convert): CI runs them after `test`
test-slow: setup
	$(PY) -m pytest -q -m "slow and not gpu" --durations=20

test-all: setup
	$(PY) -m pytest -q

clean:
	rm -rf runs outputs .pytest_cache
