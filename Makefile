# Two entry points: `make demo` (the main job) and `make test`. Both set up .venv first.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-all clean

setup:
	@bash scripts/setup_venv.sh

demo: setup
	$(PY) -m skyrl_mega.cli demo

test: setup
	$(PY) -m pytest -q -m "not slow and not gpu" --durations=40

test-all: setup
	$(PY) -m pytest -q

clean:
	rm -rf runs outputs .pytest_cache
