"""Hidden-state capture on SGLang's real ModelRunner (CPU engine, one rank) beside the project's local
extractor, on the same rendered prompts, with the largest difference between the two (needs ``make sglang``).

Capture seconds are one forward of the whole corpus as one batch, after the model is built (SGLang's
build time is printed apart); the local extractor's are its ``extract`` over the same rows. Float32.

    .venv/bin/python benchmarks/sglang_capture.py [--prompts 16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from results import record  # noqa: E402

from eagle3_assets.engines.local.extractor import LocalExtractor  # noqa: E402
from eagle3_assets.engines.sglang.cpu import server_environment  # noqa: E402
from eagle3_assets.engines.sglang.server import default_python  # noqa: E402
from eagle3_assets.paths import BUNDLED, DataLayout  # noqa: E402
from eagle3_assets.prompts.reader import read_prompt_file  # noqa: E402
from eagle3_assets.target.embedded import EmbeddedModel, ensure_default_model  # noqa: E402

LAYERS = [1, 14, 27]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    args = ap.parse_args()
    model_dir = ensure_default_model(DataLayout.from_env().models_dir)
    prompts = read_prompt_file(BUNDLED / "demo_prompts" / "general.jsonl").prompts[: args.prompts]
    model = EmbeddedModel(model_dir)
    rows = [list(model.render_prompt(p.messages)) for p in prompts]
    del model
    tokens = sum(map(len, rows))

    extractor = LocalExtractor(model_dir, layer_ids=LAYERS)
    t0 = time.perf_counter()
    feats = extractor.extract(rows)
    local_s = time.perf_counter() - t0
    local = {k: torch.cat([getattr(f, k) for f in feats]).float() for k in ("aux", "last")}
    del extractor, feats

    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.pt"
        spec.write_text(json.dumps({"model": str(model_dir), "layer_ids": LAYERS, "rows": rows}))
        env = server_environment()
        env["PYTHONPATH"] += os.pathsep + str(ROOT)
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        subprocess.run([default_python(), "-m", "eagle3_assets.engines.sglang.cpu.run_capture", str(spec), str(out)],
                       env=env, check=True, capture_output=True)
        got = torch.load(out)
    diff = {k: (got[k].float() - local[k]).abs().max().item() for k in ("aux", "last")}
    figures = {"rows": len(rows), "tokens": tokens,
               "local_s": round(local_s, 3), "local_tokens_per_s": round(tokens / local_s, 1),
               "sglang_build_s": round(got["build_s"], 2), "sglang_capture_s": round(got["capture_s"], 3),
               "sglang_tokens_per_s": round(tokens / got["capture_s"], 1),
               "max_abs_diff_aux": diff["aux"], "max_abs_diff_last": diff["last"]}
    for k, v in figures.items():
        print(f"{k:>22}: {v}")
    record("sglang_capture", figures, note="float32, one batch, one rank, SGLang's CPU engine (torch_native)")


if __name__ == "__main__":
    main()
