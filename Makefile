# Set-up is part of every target: a fresh machine needs only python3 and make.
VENV ?= .venv
PY := $(VENV)/bin/python
TB := $(VENV)/bin/tokenbridge

.PHONY: demo test bench

$(VENV)/.installed: pyproject.toml requirements-trainers.txt requirements-oracles.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,trainers]'
	$(PY) -m pip install -q --no-deps -r requirements-trainers.txt
	$(PY) -m pip install -q --no-deps -r requirements-oracles.txt
	touch $@

demo: $(VENV)/.installed
	$(TB) run examples/demo.toml

test: $(VENV)/.installed
	$(VENV)/bin/pytest

bench: $(VENV)/.installed
	$(PY) bench/bench_reconstruct.py
	$(PY) bench/bench_generate.py
	$(PY) bench/bench_fidelity.py
