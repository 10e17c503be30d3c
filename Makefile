# Two commands: `make demo` and `make test`. Both create .venv here and install on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench fetch tune-default

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU build of torch, from the local wheel cache where there is one (no multi-GB CUDA build).
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev,ray]'
	touch $(STAMP)

fetch: $(STAMP)
	$(BIN)/eeserve fetch

demo: fetch
	$(BIN)/eeserve generate --model smollm2 --chat --max-tokens 96 \
		--prompt "Explain in three sentences why the sky is blue."

lint: $(STAMP)
	$(BIN)/ruff check eeserve tests
	$(BIN)/ruff format --check eeserve tests
	$(BIN)/mypy eeserve

test: fetch lint
	$(BIN)/python -m pytest -q tests

bench: fetch
	$(BIN)/eeserve bench

# The tuned exit heads shipped for the default model (eeserve/data/smollm2): self-generated data,
# distillation, probes, held-out report (tune_report.md). About 25 minutes on 2 CPU cores.
tune-default: fetch
	$(BIN)/eeserve tune-exits smollm2 --exit-layers 6,10,14,18,22,26 --out eeserve/data/smollm2 --seed 0
