#!/usr/bin/env bash
# Build .venv-speculators: vLLM's speculators 0.9.0 (the reference EAGLE-3 trainer) on the CPU
# torch, for `benchmarks/drafter_quality.py --reference`. Kept apart from .venv, which must never
# hold speculators.
#
# Pins (what is installed, and why):
#   torch==2.13.0          the CPU wheel (pip's find-links here carries torch-2.13.0+cpu); an
#                          unpinned torch resolves to a multi-GB CUDA build
#   speculators==0.9.0     installed with --no-deps, then its requirements one by one with torch
#   hs-connectors==0.9.0   already satisfied (speculators.train imports it)
#   transformers<=5.19.0   speculators' own bounds
#   (not installed)        torchvision and torchaudio: speculators lists them but never imports
#                          them, and their newest releases require a newer torch, which would make
#                          pip replace the CPU build; the script checks they are absent at the end
#
# Usage: bash benchmarks/reference_env.sh [VENV_DIR]   (default .venv-speculators beside this repo)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv-speculators}"
py="${PYTHON:-python3}"

TORCH="torch==2.13.0"
SPECULATORS="speculators==0.9.0"
# speculators 0.9.0's Requires-Dist, less torch, torchvision and torchaudio (bounds as published)
DEPS=(
  "hs-connectors==0.9.0" aiohttp click "datasets>=4.0.0,<=5.1.0" httpx huggingface-hub
  "loguru>=0.7.2,<=0.7.3" "numpy>=2.0.0,<=2.5.4" "openai>=2.0.0" protobuf psutil "pydantic>=2.0.0"
  "pydantic-settings>=2.0.0" rich safetensors "tqdm>=4.66.3,<=4.70.1" "transformers>=5.0.0,<=5.19.0"
  "typer>=0.12.0"
)

if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install --upgrade pip >/dev/null
"${pip[@]}" install "$TORCH"
# torch stays as installed: a constraint makes any resolution that would move it fail instead
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "$TORCH" >"$constraints"
"${pip[@]}" install -c "$constraints" "${DEPS[@]}"
"${pip[@]}" install --no-deps "$SPECULATORS"

# What a run needs, and what must not be there.
"$venv/bin/python" - <<'EOF'
import importlib.metadata
import importlib.util

import torch
import speculators.train.trainer  # noqa: F401  (the trainer's own imports: hs_connectors, transformers)

version = importlib.metadata.version("speculators")
assert torch.__version__.startswith("2.13.0") and "+cpu" in torch.__version__, torch.__version__
assert version == "0.9.0", version
absent = [m for m in ("torchvision", "torchaudio") if importlib.util.find_spec(m) is not None]
assert not absent, f"{absent} installed: they would need a torch other than the CPU build"
print(f"ok: torch {torch.__version__}, speculators {version}")
EOF
