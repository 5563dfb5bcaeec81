PYTHON ?= python
PROFILE ?= quick
# make figures draws from the runs that exist; COMPUTE=1 first computes the profile's missing runs
COMPUTE ?=
# COMPUTE=1: image data for the DNN runs, a folder with the CIFAR files (see docs/dnn.md; empty: $$FEDPM_DATA);
# minutes of computing (empty: all of it); EXECUTOR=ray spreads the runs over the GPUs
DATA ?=
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
	$(if $(COMPUTE),,$(if $(DATA)$(BUDGET),$(error DATA and BUDGET apply to COMPUTE=1 (make figures only draws without it))))
	$(PYTHON) -m figures --profile $(PROFILE) $(if $(COMPUTE),--compute --executor $(EXECUTOR) \
		$(if $(DATA),--data-dir $(DATA),) $(if $(BUDGET),--budget-minutes $(BUDGET),),)

superlinear:
	$(PYTHON) -m validation.superlinear --dataset w8a
	$(PYTHON) -m validation.superlinear --dataset a9a

bench:
	$(PYTHON) -m validation.bench_convex
	$(PYTHON) -m validation.bench_dnn
