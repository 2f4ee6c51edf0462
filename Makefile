# Set-up is part of every target: a fresh machine needs only python3 and make.
# `make demo` installs the package alone (what `pip install tokenbridge` gives a user);
# `make test` adds the test tools and the trainers' own loaders (torch, SpecForge,
# speculators), which only the test suite uses. Each set has its own stamp. The suite runs on
# every core (pytest-xdist, at most 4 workers), then the tests marked `serial` (they assert on
# the wall clock) alone, whether or not the first part failed: 14 + 2 min on 2 cores, against
# 26 min in one process.
VENV ?= .venv
PY := $(VENV)/bin/python
TB := $(VENV)/bin/tokenbridge

.PHONY: demo test bench

$(VENV)/.installed-demo: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-demo requirements-trainers.txt requirements-oracles.txt
	$(PY) -m pip install -q -e '.[test,trainers]'
	$(PY) -m pip install -q --no-deps -r requirements-trainers.txt
	$(PY) -m pip install -q --no-deps -r requirements-oracles.txt
	touch $@

demo: $(VENV)/.installed-demo
	$(TB) run examples/demo.toml

test: $(VENV)/.installed-test
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest -n auto --maxprocesses 4 -m 'not serial'; status=$$?; \
	$(VENV)/bin/pytest -m serial && exit $$status

bench: $(VENV)/.installed-test
	$(PY) bench/bench_reconstruct.py
	$(PY) bench/bench_generate.py
	$(PY) bench/bench_fidelity.py
	$(PY) bench/bench_limiter.py
