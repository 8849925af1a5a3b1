"""Drafter training at 1x and 8x the corpus: peak memory and tokens/s, then acceptance.

Builds training features with the embedded target (greedy responses to the demo prompts),
writes them as hidden-state shards once (1x) and eight times over (8x, distinct sample
ids; the 1x corpus itself repeats the generated samples ``--base-copies`` times), and trains
the recipe's drafter for the same number of steps on each, every run in a fresh process so
its peak RSS is its own:

- ``stream``: the trainer as the asset runs it (``run_job``: shards read per batch);
- ``memory`` (the yardstick): every sample of the mixture copied into RAM first, as the
  trainer did before it streamed;

and it reads every sample of each corpus once, through the trainer's ``pread`` reader and
through safetensors' memory-mapped views, reporting how much the process grows with each.

It prints peak RSS (``ru_maxrss``), the largest RSS seen after a training step, the bytes of
samples the dataset keeps, and training tokens/s per run, with the 8x/1x ratios (target:
streaming peak RSS within 10%), then the acceptance length (SGLang convention:
accepted + 1 per verification) of the 1x streaming drafter against an untrained one of the
same shape on held-out prompts, both checked against plain greedy decoding.

Run: ``.venv/bin/python benchmarks/drafter.py [--recipe demo] [--steps 40] [--scale 8]``
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from results import record  # noqa: E402

from eagle3_assets.drafter.recipes import load_recipe  # noqa: E402
from eagle3_assets.drafter.training.config import ExportSettings, RuntimeSettings, TrainJob  # noqa: E402
from eagle3_assets.paths import BUNDLED, REPO_ROOT, DataLayout  # noqa: E402
from eagle3_assets.target.ref import TargetRef  # noqa: E402


def generated_data(model, datasets: list[str], per_dataset: int, eval_per_dataset: int, max_new_tokens: int):
    """Greedy responses to the demo prompts: (train sequences by dataset, held-out prompts)."""
    from eagle3_assets.prompts.reader import read_prompt_file

    train, held_out = {}, []
    for name in datasets:
        path = BUNDLED / "demo_prompts" / f"{name}.jsonl"
        prompts = [model.render_prompt(p.messages) for p in read_prompt_file(path).prompts]
        fit, rest = prompts[:per_dataset], prompts[per_dataset:]
        held_out += rest[:eval_per_dataset]
        gens = model.generate(fit, max_new_tokens=max_new_tokens)
        train[name] = [(p + g.output_ids, [0] * len(p) + [1] * len(g.output_ids)) for p, g in zip(fit, gens)]
    return train, held_out


def write_corpus(root: Path, feats: dict, layer_ids: list[int], copies: int) -> dict[str, float]:
    """Shard directories holding ``copies`` copies of every dataset's features."""
    from eagle3_assets.hidden_states.write import write_samples

    dirs = {}
    for name, samples in feats.items():
        out = root / f"x{copies}" / name
        write_samples(out, (s for _ in range(copies) for s in samples), layer_ids=layer_ids, num_layers=30,
                      target={"name": "smollm2", "id": "benchmark"}, shard_bytes=64 << 20)
        dirs[str(out)] = 1.0
    return dirs


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def held_bytes(dataset) -> int:
    """Bytes of sample tensors the dataset object keeps between batches."""
    items = getattr(dataset, "items", [])
    return sum(t.numel() * t.element_size() for item in items for t in item.values() if isinstance(t, torch.Tensor))


def train_once(job_path: Path, mode: str) -> dict:
    """One measured run in this process: ``stream`` (run_job) or ``memory`` (the yardstick)."""
    from torch.utils.data import Dataset

    from eagle3_assets.drafter.training import job as job_mod
    from eagle3_assets.drafter.training.data import ShardDataset

    job = TrainJob.from_json(job_path)
    torch.set_num_threads(job.runtime.threads)
    if mode == "memory":
        real = ShardDataset

        class InMemory(Dataset):  # every sample read up front and kept, as load_features did
            def __init__(self, *a, **kw):
                self.inner = real(*a, **kw)
                self.items = [self.inner[i] for i in range(len(self.inner))]

            def __getattr__(self, name):
                return getattr(self.__dict__["inner"], name)

            def __len__(self):
                return len(self.items)

            def __getitem__(self, i):
                return self.items[i]

        job_mod.ShardDataset = InMemory
    made = []
    real_batches = job_mod.ShardBatches

    def batches(dataset, *a, **kw):
        made.append(dataset)
        return real_batches(dataset, *a, **kw)

    job_mod.ShardBatches = batches
    step_rss = []
    t0 = time.perf_counter()
    summary = job_mod.run_job(job, on_metrics=lambda m: step_rss.append(rss_mib()))
    return {"mode": mode, "peak_rss_mib": peak_rss_mib(), "tokens_per_s": summary["tokens_per_s"],
            "train_rss_mib": max(step_rss), "held_mib": held_bytes(made[0]) / 2**20,
            "steps": summary["steps"], "wall_s": time.perf_counter() - t0, "samples": summary["train_samples_per_epoch"],
            "data_share": summary["data_share"], "sglang_dir": summary.get("sglang_dir")}


def scan_once(job_path: Path, mode: str) -> dict:
    """Read every training sample once (``pread``: the trainer's reader; ``mmap``: safetensors
    views, the reader before) and report how much the process grew."""
    from safetensors import safe_open

    from eagle3_assets.drafter.training.data import ShardDataset

    job = TrainJob.from_json(job_path)
    dataset = ShardDataset(job.datasets, max_length=job.training.max_length)
    before, total = rss_mib(), 0
    if mode == "pread":
        for i in range(len(dataset)):
            total += int(dataset[i]["aux_hidden"].float().sum().isfinite())
    else:
        handles = []
        for reader in dataset.readers:
            for shard in sorted({reader.location(s)[0] for s in reader.sample_ids()}):
                h = safe_open(str(reader.dir / shard), framework="pt")
                handles.append(h)
                total += int(h.get_slice("aux_hidden")[:].float().sum().isfinite())
    return {"mode": mode, "grew_mib": rss_mib() - before, "samples": len(dataset)}


def measured(job_path: Path, mode: str) -> dict:
    res = subprocess.run([sys.executable, __file__, "--train-once", str(job_path), "--mode", mode],
                         capture_output=True, text=True, cwd=REPO_ROOT)
    if res.returncode:
        raise RuntimeError(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="demo")
    ap.add_argument("--per-dataset", type=int, default=16, help="generated training samples per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="length of generated training responses")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core box)")
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps of every measured run")
    ap.add_argument("--scale", type=int, default=8, help="the large corpus is this many copies of the small one")
    ap.add_argument("--base-copies", type=int, default=4, help="the 1x corpus repeats the generated samples this often")
    ap.add_argument("--train-once", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="stream", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.train_once:
        scan = args.mode in ("pread", "mmap")
        print(json.dumps(scan_once(args.train_once, args.mode) if scan else train_once(args.train_once, args.mode)))
        return
    torch.set_num_threads(args.threads)

    from eagle3_assets.drafter.spec_decode import evaluate_acceptance, greedy_generate, target_features, untrained_baseline
    from eagle3_assets.target.embedded import EmbeddedModel, ensure_default_model

    recipe = load_recipe(args.recipe)
    model_dir = ensure_default_model(DataLayout.from_env().models_dir)
    target = EmbeddedModel(model_dir)
    ev = recipe.evaluation
    datasets = sorted(recipe.datasets)
    t0 = time.perf_counter()
    seqs, held_out = generated_data(target, datasets, args.per_dataset, -(-ev.eval_samples // len(datasets)),
                                    args.max_new_tokens)
    held_out = held_out[: ev.eval_samples]
    layer_ids = recipe.shape.aux_layer_ids or [1, 14, 26]
    feats = {name: target_features(target.model, [s for s, _ in rows], [m for _, m in rows], layer_ids)
             for name, rows in seqs.items()}
    t_data = time.perf_counter() - t0
    tokens = sum(len(s["input_ids"]) for v in feats.values() for s in v)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        runs = {}
        for copies in (1, args.scale):
            dirs = write_corpus(root, feats, layer_ids, copies * args.base_copies)
            for mode in ("stream", "memory"):
                job = TrainJob(target=TargetRef(model_dir=str(model_dir)), out_dir=str(root / f"out-{copies}-{mode}"),
                               datasets=dirs,
                               training=recipe.training.model_copy(update={"max_steps": args.steps, "epochs": None,
                                                                           "warmup_steps": 0}),
                               shape=recipe.shape, runtime=RuntimeSettings(threads=args.threads, progress=False),
                               export=ExportSettings(engines=("sglang",)) if (copies, mode) == (1, "stream") else None)
                runs[copies, mode] = measured(job.write(root / f"job-{copies}-{mode}.json"), mode)
            scans = {m: measured(root / f"job-{copies}-stream.json", m) for m in ("pread", "mmap")}
            runs[copies, "stream"]["scan"] = scans

        print(f"recipe {recipe.name}: {args.per_dataset} greedy responses per dataset ({', '.join(datasets)}), "
              f"repeated {args.base_copies}x: {tokens * args.base_copies} tokens at 1x; data {t_data:.1f}s; "
              f"torch threads {args.threads}; {args.steps} steps per run, "
              f"batch {recipe.training.batch_size}, ttt_steps {recipe.training.ttt_steps}")
        print(f"{'trainer':>24} {'corpus':>7} {'samples':>8} {'peak RSS MiB':>13} {'max RSS in steps':>17} "
              f"{'samples held MiB':>17} {'tokens/s':>9} {'data share':>11}")
        for (copies, mode), r in runs.items():
            name = "streaming shards" if mode == "stream" else "in memory (yardstick)"
            print(f"{name:>24} {copies:>6}x {r['samples']:>8} {r['peak_rss_mib']:>13.0f} {r['train_rss_mib']:>17.0f} "
                  f"{r['held_mib']:>17.0f} {r['tokens_per_s']:>9.0f} {100 * r['data_share']:>10.1f}%")
        for mode in ("stream", "memory"):
            a, b = runs[1, mode], runs[args.scale, mode]
            print(f"{mode}: {args.scale}x/1x peak RSS = {b['peak_rss_mib'] / a['peak_rss_mib']:.3f}, "
                  f"max RSS in steps = {b['train_rss_mib'] / a['train_rss_mib']:.3f}, "
                  f"tokens/s = {b['tokens_per_s'] / a['tokens_per_s']:.3f}")
        for copies in (1, args.scale):
            sc = runs[copies, "stream"]["scan"]
            print(f"reading all {sc['pread']['samples']} samples of the {copies}x corpus once: the process grows "
                  f"{sc['pread']['grew_mib']:.0f} MiB with the trainer's pread reader, "
                  f"{sc['mmap']['grew_mib']:.0f} MiB through safetensors memory-mapped views")
        s8, m8 = runs[args.scale, "stream"], runs[args.scale, "memory"]
        print(f"at {args.scale}x, streaming / in-memory: peak RSS {s8['peak_rss_mib'] / m8['peak_rss_mib']:.3f}, "
              f"tokens/s {s8['tokens_per_s'] / m8['tokens_per_s']:.3f}")

        from eagle3_assets.drafter import formats
        from eagle3_assets.drafter.target_weights import read_target_embeddings

        drafter = formats.load("sglang", runs[1, "stream"]["sglang_dir"], read_target_embeddings(model_dir)).float().eval()
    k, n_new = ev.speculative_k, ev.eval_max_new_tokens
    greedy = [greedy_generate(target.model, p, max_new_tokens=n_new, stop_ids=target.stop_ids) for p in held_out]
    print(f"acceptance on {len(held_out)} held-out prompts (k={k}, max_new_tokens={n_new}) after {args.steps} steps:")
    figures = {"tokens_1x": tokens * args.base_copies, "steps": args.steps, "threads": args.threads,
               "runs": {f"{mode} {copies}x": {k2: v for k2, v in r.items() if isinstance(v, (int, float))}
                        for (copies, mode), r in runs.items()}, "acceptance": {}}
    for name, d in (("trained", drafter), ("untrained", untrained_baseline(drafter, seed=recipe.training.seed))):
        rep = evaluate_acceptance(target.model, d, held_out, k=k, max_new_tokens=n_new, stop_ids=target.stop_ids,
                                  greedy_reference=greedy)
        pos = " ".join(f"{r:.2f}" for r in rep.per_position_rate)
        print(f"{name:>10}: acceptance length {rep.acceptance_length:.3f} (w/o bonus {rep.acceptance_length_no_bonus:.3f}), "
              f"per position {pos}, equals greedy: {rep.matches_greedy}")
        figures["acceptance"][name] = {"acceptance_length": rep.acceptance_length,
                                       "per_position_rate": list(rep.per_position_rate), "matches_greedy": rep.matches_greedy}
    record("drafter", figures)


if __name__ == "__main__":
    main()
