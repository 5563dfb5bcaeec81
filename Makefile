PYTHON ?= python

.PHONY: install test bench superlinear

install:
	$(PYTHON) -m pip install -e ".[dev,dnn]"

test:
	$(PYTHON) -m pytest -q

superlinear:
	$(PYTHON) -m validation.superlinear --dataset w8a
	$(PYTHON) -m validation.superlinear --dataset a9a

bench:
	$(PYTHON) -m validation.bench_convex
