# The course's commands. `make lab` and `make test` do all the set-up on a fresh machine that
# has Python ≥3.10 and pip: they create .venv, install torch (the CPU build unless an NVIDIA GPU
# is present) and this package with its extras, then open the course / run every check.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.minifer-installed
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9]*.ipynb))

.PHONY: install lab test lint notebooks bench train clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python tools/install_torch.py
	$(BIN)/python -m pip install -e ".[dev]"
	touch $(STAMP)

# Jupyter refuses to start as root unless told; containers (and Binder-like images) often run as root.
LAB_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root)

lab: $(STAMP)
	$(BIN)/jupyter lab $(LAB_ARGS) notebooks/

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP) lint
	$(BIN)/python tools/check_executed.py $(NOTEBOOKS)
	$(BIN)/python -m pytest --nbval

notebooks: $(STAMP)
	cd notebooks && ../$(BIN)/python ../tools/run_notebooks.py $(notdir $(NOTEBOOKS))

# The CPU benchmark suite (a few minutes; BENCHMARKS.md records its latest tables). On a machine
# that other programs keep busy, pin the thread count: `make bench THREADS=1`.
THREADS ?=
BENCH_THREADS := $(if $(THREADS),--threads $(THREADS))

bench: $(STAMP)
	$(BIN)/python -m minifer.bench probe
	$(BIN)/python -m minifer.bench decode $(BENCH_THREADS)
	$(BIN)/python -m minifer.bench decode --table --json bench-decode.json $(BENCH_THREADS)
	$(BIN)/python -m minifer.bench quant $(BENCH_THREADS)
	$(BIN)/python -m minifer.bench spec $(BENCH_THREADS)

# Retrain the shipped tokenizer and Shakespeare models (≈40 min on 2 CPU cores; resumable).
train: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" sh scripts/install_train_deps.sh
	$(BIN)/python -m minifer.training

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
