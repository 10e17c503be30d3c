# Two commands: `make demo` and `make test`. Both create .venv here and install on first use.
# `make test-fast` is the edit loop: the suite without the tests marked slow (no lint, no fetch).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CHROMIUM := /usr/bin/chromium
CHROMEDRIVER := /usr/bin/chromedriver

.PHONY: demo test test-fast lint bench fetch tune-default tune-default-ee tune-gemma3 browser

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
	$(BIN)/ruff check eeserve tests bench/scripts
	$(BIN)/ruff format --check eeserve tests bench/scripts
	$(BIN)/mypy eeserve

# Headless Chromium for the playground's browser tests (tests/test_playground.py). Installed with
# apt where it is missing and apt-get can run (root); elsewhere those tests skip, saying why.
browser:
	@if [ ! -x $(CHROMIUM) ] || [ ! -x $(CHROMEDRIVER) ]; then \
		if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
			(apt-get update -q && DEBIAN_FRONTEND=noninteractive \
				apt-get install -y -q chromium chromium-driver) \
			|| echo "chromium not installed: the browser tests will skip"; \
		else \
			echo "no $(CHROMIUM) and no root apt-get: the browser tests will skip"; \
		fi; \
	fi

# The whole suite; it ends with its ten slowest tests (docs/engine.md#tests lists why each takes
# its time).
test: fetch lint browser
	$(BIN)/python -m pytest -q --durations=10 tests

# Everything but the tests marked slow (the real models, Ray and Ray Serve, live servers of their
# own, the browser, tune-exits end to end): about a minute on 2 cores.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

bench: fetch
	$(BIN)/eeserve bench

# The tuned exit heads shipped for the default model (eeserve/data/smollm2): self-generated data,
# distillation, probes, held-out report (tune_report.md), then the vocabulary shortlist of the cheap
# exit checks. About 30 minutes on 2 CPU cores.
tune-default: fetch
	$(BIN)/eeserve tune-exits smollm2 --exit-layers 6,10,14,18,22,26 --out eeserve/data/smollm2 --seed 0 \
		--default-mode speculative --default-draft int8 --draft-vocab 8192
	$(BIN)/eeserve shortlist smollm2 --out eeserve/data/smollm2

# gemma3-270m's tuned exit heads (eeserve/data/gemma3-270m), then its 32,768-id shortlist, which
# its int8 drafts project onto, then the calibrated classifier threshold. About an hour on 2 CPU
# cores.
tune-gemma3: $(STAMP)
	$(BIN)/eeserve tune-exits gemma3-270m --exit-layers 3,6,9,12,15 --out eeserve/data/gemma3-270m \
		--seed 0 --default-mode speculative --default-draft int8 --draft-vocab 0
	$(BIN)/eeserve shortlist gemma3-270m --size 32768 --int8-draft-vocab 32768 --prompts 256 \
		--out eeserve/data/gemma3-270m
	$(BIN)/eeserve calibrate gemma3-270m --delta 0.05 --epsilon 0.05 --n 100 --max-tokens 96 \
		--check-n 50 --out-config eeserve/data/gemma3-270m

# The default model trained to exit (`LLM("smollm2-ee")`, eeserve/data/smollm2-ee): a rank-16 base
# delta distilled from the frozen original jointly with exit heads, then heads, probes and the
# report on that variant (docs/trained-variant.md). Hours on 2 CPU cores; resumable (rerun it).
tune-default-ee: fetch
	$(BIN)/eeserve tune-exits smollm2 --train-base lora --exit-layers 6,10,14,18,22,26 \
		--out eeserve/data/smollm2-ee --seed 0 --base-tokens 200000 --lora-rank 16 \
		--lora-lr 2e-4 --final-weight 8
	$(BIN)/eeserve shortlist smollm2-ee --out eeserve/data/smollm2-ee
