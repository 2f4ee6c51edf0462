# Set-up is part of every target: a fresh machine needs only python3 and make.
VENV ?= .venv
PY := $(VENV)/bin/python
TB := $(VENV)/bin/tokenbridge

.PHONY: demo test bench

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(TB) reconstruct examples/exchanges.jsonl -o runs/demo/reconstructed.jsonl --tokenizer ../shared/tokenizers/kimi-k2.5 || true
	$(TB) inspect runs/demo/reconstructed.jsonl --tokenizer ../shared/tokenizers/kimi-k2.5 --id ex-tool

test: $(VENV)/.installed
	$(VENV)/bin/pytest

bench: $(VENV)/.installed
	$(PY) bench/bench_reconstruct.py
