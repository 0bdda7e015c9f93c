# Two commands do all setup on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test quick test-all gpu-check bench install clean browser slurm

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Both sides of data parallelism on CPU workers (one thread each, standing for a device): a compute-bound
# GPT step, where 2 workers should pay, then the 85k-parameter digits MLP, where the all-reduce dominates.
demo: $(STAMP)
	$(VENV)/bin/multigpu study --cpu --repeats 3 gpt-ddp
	$(VENV)/bin/multigpu study --cpu --policy keep-global,scale-global digits

# Every test, the ones marked slow too (the multi-rank proofs of 4-8 ranks, real tunes and studies: the
# project's main claims); CI runs this (.ci/run). `make quick` leaves the slow ones out, for your own loop.
test: $(STAMP) browser slurm
	$(PY) -m pytest -q --durations=40

quick: $(STAMP) browser slurm
	$(PY) -m pytest -q -m "not slow"

# The old name of `make test`.
test-all: test

# The report test drives a real headless Chromium (Debian's package; playwright
# uses it via executable_path, no browser download). Without apt it is skipped.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  (command -v apt-get >/dev/null 2>&1 && (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null 2>&1) || \
	  echo "multigpu: no Chromium could be installed; the report's browser test will be skipped"

# Separate hosts and a real SLURM (tests/test_hosts.py, tests/test_slurm.py) need root, iproute2's ip and
# Debian's slurm-wlm with munge (installed in ~5 s here, apt-get update aside). Without root or apt those
# tests are skipped in one line.
slurm:
	@(command -v slurmd && command -v munged && command -v ip) >/dev/null 2>&1 || \
	  ([ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && (apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge iproute2) >/dev/null 2>&1) || \
	  echo "multigpu: slurm-wlm, munge or iproute2 could not be installed; the SLURM and separate-host tests will be skipped"

gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) multigpu_logs runs studies
