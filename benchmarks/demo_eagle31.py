"""EAGLE 3.0 against 3.1 at the demo's own scale: the bundled ``demo`` recipe and its twin with
``fc_norm`` and ``norm_output`` on, trained and measured on one demo data root.

Why: the ablation (``drafter_quality.py``) says 3.1 gains on its data; whether the bundled default
should switch is a question about the demo's data and drafter, so it is measured there. Each row is
the ``drafter_checkpoint`` asset's own evaluation (``eval.json``: the real chain decoder, k=3, on the
recipe's held-out prompts), one line of JSON per row.

    .venv/bin/python benchmarks/demo_eagle31.py --root /tmp/demo31            # seed 0, both variants
    .venv/bin/python benchmarks/demo_eagle31.py --root /tmp/demo31 --seeds 0 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def write_recipes(root: Path, seeds: list[int]) -> list[str]:
    """The demo recipe per seed, as 3.0 (``demo_s<seed>``) and as 3.1 (``demo31_s<seed>``)."""
    from eagle3_assets.drafter.recipes import BUNDLED_RECIPES

    base = (BUNDLED_RECIPES / "demo.toml").read_text(encoding="utf-8")
    assert "seed = 0" in base and "feature_noise = 0.1" in base
    (root / "recipes").mkdir(parents=True, exist_ok=True)
    names = []
    for seed in seeds:
        for name, on in ((f"demo_s{seed}", False), (f"demo31_s{seed}", True)):
            text = base.replace("seed = 0", f"seed = {seed}")
            if on:
                text = text.replace("feature_noise = 0.1", "feature_noise = 0.1\nfc_norm = true\nnorm_output = true")
            (root / "recipes" / f"{name}.toml").write_text(text, encoding="utf-8")
            names.append(name)
    return names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, required=True, help="a data root of its own (the demo's datasets go there)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = ap.parse_args()
    root = args.root.resolve()
    os.environ["EAGLE3_HOME"] = str(root)
    if not (root / "hidden_states").exists():  # the demo's datasets and hidden states, once
        subprocess.run([sys.executable, "-m", "eagle3_assets.cli", "demo"], check=True)
    names = write_recipes(root, args.seeds)  # before the definitions are imported: recipes are partitions
    from eagle3_assets.cli import _instance
    from eagle3_assets.launch import materialize_selection
    from eagle3_assets.paths import DataLayout

    layout = DataLayout(root)
    instance = _instance(layout)
    for name in names:
        t0 = time.perf_counter()
        result = materialize_selection(instance, ["drafter_checkpoint"], name, {"ops": {"drafter_checkpoint": {"config": {}}}})
        ev = json.loads((layout.drafter_dir(name) / "eval.json").read_text())
        t = ev["trained"]
        print(json.dumps({"row": name, "ok": result.success, "s": round(time.perf_counter() - t0), "prompts": ev["prompts"],
                          "k": ev["k"], "al": t["acceptance_length"], "per_position": t["per_position_rate"],
                          "matches_greedy": t["matches_greedy"]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
