# herald_torchrec — `make train` runs the default job, `make test` the test suite; both set up .venv first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
NPROC  ?= 2
STAMP  := $(VENV)/.herald-setup-v1
ARGS   ?=

.PHONY: setup train lint format test test-slow test-gpu bench simulate clean

setup: $(STAMP)

$(STAMP): scripts/setup.sh pyproject.toml
	@bash scripts/setup.sh

# scripts/launch.py is torchrun that ends a user mistake with its one error line and exit 2 (README, Running);
# the variable keeps torchrun's restarts (--max-restarts) from hanging: README, Restarts
train: setup
	TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 $(PY) scripts/launch.py --standalone --nproc_per_node $(NPROC) train.py $(ARGS)

lint: setup   # the formatter and the linter (configured in pyproject.toml); `make format` applies the formatting
	$(VENV)/bin/ruff format --check . || (echo "ruff format: files above need formatting; run 'make format'" && exit 1)
	$(VENV)/bin/ruff check --quiet .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: lint
	$(PY) -m pytest -q $(ARGS)

test-slow: setup
	$(PY) -m pytest -q -m slow $(ARGS) || [ $$? -eq 5 ]   # 5: no slow case collected

test-gpu: setup   # the `cuda`-marked tests (tests/scenarios/test_cuda_parity.py); needs a CUDA GPU
	$(PY) -m pytest -q -m cuda $(ARGS)

simulate: setup
	OMP_NUM_THREADS=1 $(PY) benchmarks/simulate.py --json $(ARGS)

bench: setup
	$(PY) benchmarks/e2e.py --out benchmarks/results/e2e.json $(ARGS)

clean:
	rm -rf runs .pytest_cache
