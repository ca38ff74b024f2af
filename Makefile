# Targets match the README. Each creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: venv test demo lint format bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints-cpu.txt torch
	$(BIN)/pip install --quiet -c constraints-cpu.txt -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	RAY_AUTH_MODE=disabled $(BIN)/python -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	RAY_AUTH_MODE=disabled $(BIN)/envloop run examples/demo.yaml

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy envloop

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	RAY_AUTH_MODE=disabled $(BIN)/python benchmarks/rollout_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis
