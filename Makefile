# Targets match the README. Each creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?= --durations=25  # the slowest tests, to keep the suite within its time

.PHONY: venv test demo lint format bench docs docs-serve clean llama-server

venv: $(STAMP)

# pip's output (and setuptools' editable-install banner) goes to $(LOG); shown only on failure.
LOG := $(VENV)/install.log

$(STAMP): pyproject.toml constraints-cpu.txt
	@echo "installing CPU-only torch and envloop (editable, with its extras) into $(VENV) (log: $(LOG))"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@{ $(BIN)/pip install --upgrade pip \
	  && $(BIN)/pip install -c constraints-cpu.txt torch \
	  && $(BIN)/pip install -c constraints-cpu.txt -e '.[dev,trl,docs,agents]'; } > $(LOG) 2>&1 \
	  || { tail -n 40 $(LOG); echo "install failed; the whole log is $(LOG)"; exit 1; }
	@touch $(STAMP)

# llama-server for the server tests: built once (6-25 minutes on 2 cores) into a cache folder
# that every clone shares (~/.cache/envloop/llama.cpp-<version>; $$ENVLOOP_LLAMA_DIR overrides).
llama-server: $(STAMP)
	@bash scripts/build_llama_server.sh $(BIN)/python > /dev/null

test: $(STAMP) llama-server
	RAY_AUTH_MODE=disabled $(BIN)/python -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	@echo "demo: envloop run examples/demo.yaml (the bundled tiny policy on math with retries,"
	@echo "      sliding puzzles and a bundled reward model; 24 prompts x 2 samples, Ray actors)"
	@RAY_AUTH_MODE=disabled $(BIN)/envloop run examples/demo.yaml
	@echo "demo: envloop run examples/vlm_demo.yaml (the bundled tiny vision-language policy"
	@echo "      counts and locates coloured shapes in 24 pictures, one generation each)"
	@RAY_AUTH_MODE=disabled $(BIN)/envloop run examples/vlm_demo.yaml
	@echo "demo: done; open runs/demo/report.html and runs/vlm_demo/report.html in a browser,"
	@echo "      or read their rollouts.jsonl"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy envloop

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	RAY_AUTH_MODE=disabled $(BIN)/python benchmarks/rollout_overhead.py

# The documentation site (mkdocs.yml, pages under docs/): --strict fails on a broken link,
# anchor or API reference.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict

clean:
	rm -rf $(VENV) site .pytest_cache .ruff_cache .mypy_cache .hypothesis
