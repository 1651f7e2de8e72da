# Two entry points for a fresh machine: `make demo` and `make test`. Both create .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test test-slow bench bench-quick lint clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The pin matters: torch 2.13.0 is a CPU build on disk here; anything else downloads a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,bench]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/deltarefit demo

test: $(VENV)/.installed
	$(PY) -m pytest -q

test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow

bench: $(VENV)/.installed
	$(VENV)/bin/deltarefit bench --markdown docs/BENCHMARKS.md

bench-quick: $(VENV)/.installed
	$(VENV)/bin/deltarefit bench --quick

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
