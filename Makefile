# pdengine — set-up, checks, benchmarks. `make install` then `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
export UCX_NET_DEVICES ?= lo
export UCX_TLS ?= tcp,self,sm

.PHONY: install test test-slow lint layers bench docs clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

install: $(PY)
	# torch first, pinned: the CPU wheel on local disk; a range would pull a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'

lint:
	$(VENV)/bin/ruff check pdengine tests benchmarks tools

layers:
	$(VENV)/bin/lint-imports

test: lint layers
	$(PY) tools/gen_docs.py --check
	$(PY) -m pytest -q

test-slow:
	$(PY) -m pytest -q -m slow

docs:
	$(PY) tools/gen_docs.py

bench:
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
