# Two commands: `make demo` and `make test`. Both set up .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test setup bench clean

$(STAMP): pyproject.toml $(wildcard csrc/*.c)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch lies on this machine's disk; pin it before anything pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m autopar.cli.demo

# The linter runs first ([tool.ruff] in pyproject.toml); a finding fails the target before pytest starts.
# The suite runs as two pytest processes side by side (tests/shards.py says why); the runner exits
# with a shard's non-zero status (5, nothing collected, included) and make propagates it.
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m tests.shards -q

bench: $(STAMP)
	$(PY) benchmarks/trace.py

clean:
	rm -rf $(VENV) build *.egg-info
