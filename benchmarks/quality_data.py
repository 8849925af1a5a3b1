"""The drafter-quality benchmark's data: each data variant (``quality_recipes.DATA``) through the
project's own stages in the benchmark's Dagster instance, from one prompt file."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from quality_recipes import DATA, MAX_NEW_TOKENS, corpus_figures, uptime


def make_data(root: Path, prompts: Path, names: list[str], *, backend: str, max_samples: int = 0) -> dict:
    """Each data variant through the project's stages; what is on disk already is kept. Replies
    come from the embedded target (``local``) or from a vLLM server started here (``vllm``: about
    10x faster on CPU, and a seed per sample)."""
    import contextlib

    import dagster as dg

    from eagle3_assets.paths import DataLayout, ensure_dagster_home

    layout = DataLayout.from_env()
    ensure_dagster_home(layout)
    from eagle3_assets.definitions import ALL_ASSETS, ALL_CHECKS, DATA_ASSETS, default_resources
    from eagle3_assets.engines.vllm.server import VLLMServer
    from eagle3_assets.launch import materialize_selection
    from eagle3_assets.partitions import datasets_partitions
    from eagle3_assets.resources import VLLMResource
    from eagle3_assets.target.embedded import ensure_default_model

    instance = dg.DagsterInstance.get()
    known = set(instance.get_dynamic_partitions(datasets_partitions.name))
    instance.add_dynamic_partitions(datasets_partitions.name, [n for n in names if n not in known])
    todo = [n for n in names if not (layout.hidden_states_dir(n) / "manifest.json").exists()]
    server = contextlib.nullcontext()
    if todo and backend == "vllm":
        server = VLLMServer(ensure_default_model(layout.models_dir), role="generate", max_model_len=2048,
                            env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})  # both cores compute
    report, seconds, complete = {}, {}, []
    with server:  # phase 1: every variant's replies and corpus while the server is up
        resources = default_resources()
        if backend == "vllm" and todo:
            resources["vllm"] = VLLMResource(base_urls=[server.api_url], endpoint="completions")
        for name in names:
            layout.prompts_dir.mkdir(parents=True, exist_ok=True)
            dst = layout.prompt_source(name)
            if not dst.exists():
                shutil.copyfile(prompts, dst)
            t0 = time.perf_counter()
            if name in todo:
                gen = {"backend": backend, "max_new_tokens": MAX_NEW_TOKENS, "batch_size": 16, "concurrency": 32,
                       "max_samples": max_samples, **DATA[name]}
                result = dg.materialize([*ALL_ASSETS, *ALL_CHECKS], selection=[a.key for a in DATA_ASSETS],
                                        partition_key=name, instance=instance, resources=resources, raise_on_error=False,
                                        run_config={"ops": {"raw_responses": {"config": gen}}})
                if not result.success:
                    raise SystemExit(f"{name}: the dataset pipeline failed (run {result.run_id})")
                planned = sum(1 for _ in open(dst, encoding="utf-8") if _.strip()) * DATA[name]["samples_per_prompt"]
                have = sum(v["samples"] for v in corpus_figures(layout, name).values())
                if have < planned:
                    print(f"data {name}: {have}/{planned} samples so far; run again to continue", flush=True)
                    continue
            seconds[name] = time.perf_counter() - t0
            complete.append(name)
    # phase 2: hidden states once the server is stopped and its memory back
    for name in complete:
        t0 = time.perf_counter()
        if name in todo:
            result = materialize_selection(instance, ["hidden_states"], name, {"ops": {"hidden_states": {"config": {}}}})
            if not result.success:
                raise SystemExit(f"{name}: hidden_states failed (run {result.run_id})")
        seconds[name] += time.perf_counter() - t0
        report[name] = {**corpus_figures(layout, name), "seconds": round(seconds[name], 1)}
        print(f"data {name}: {json.dumps(report[name])} load {uptime()}", flush=True)
    return report
