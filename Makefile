PYTHON ?= python
PROFILE ?= quick
# image data for the DNN figures: a folder with the CIFAR files (see docs/dnn.md); Test 1 needs none
DATA ?= $(FEDPM_DATA)
# minutes of computing for the missing runs (empty: all of them); EXECUTOR=ray spreads them over the GPUs
BUDGET ?=
EXECUTOR ?= local

.PHONY: install lint test figures superlinear bench

install:
	$(PYTHON) -m pip install -e ".[dev,dnn,flower]"

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

test:
	$(PYTHON) -m pytest -q

figures:
	$(PYTHON) -m figures --profile $(PROFILE) $(if $(DATA),--data-dir $(DATA),) $(if $(BUDGET),--budget-minutes $(BUDGET),) \
		--executor $(EXECUTOR)

superlinear:
	$(PYTHON) -m validation.superlinear --dataset w8a
	$(PYTHON) -m validation.superlinear --dataset a9a

bench:
	$(PYTHON) -m validation.bench_convex
	$(PYTHON) -m validation.bench_dnn
