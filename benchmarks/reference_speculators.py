"""Train the reference EAGLE-3 drafter, vLLM's speculators 0.9.0, on this CPU.

Runs in its own environment (``bash benchmarks/reference_env.sh`` builds ``.venv-speculators``),
never in the project's: ``.venv-speculators/bin/python benchmarks/reference_speculators.py
--data DIR --run DIR --target DIR``. ``DIR`` of ``--data`` is what ``reference_convert.py``
wrote (``hidden_states/hs_<i>.safetensors`` + ``rows.jsonl``); this script adds speculators'
Arrow dataset and token counts next to them, then calls speculators' own training entry point
(``speculators.train.cli.main`` on a ``TrainConfig`` resolved from its command line) in this
process, with these changes made at run time, nothing edited in its files:

- CPU: the trainer's local rank resolves to ``"cpu"`` (0.9.0 moves the model and batches to
  local rank 0, a CUDA index); ``torch.accelerator.synchronize`` does nothing when there is no
  accelerator (its step timer calls it on every logged step); no ``LOCAL_RANK`` in the
  environment, so its plain non-distributed path runs. Flags: ``--hidden-states-dtype float32``
  (its autocast is CUDA-only), ``--loss-implementation eager`` (the fused loss imports triton),
  ``--draft-attn-impl sdpa`` (flex attention needs a GPU build), ``--num-workers 0``.
- Data: every row handed over is trained on. speculators splits its data 90/10 into train and
  validation itself (its validation only logs; it never changes the weights unless asked to
  keep the best epoch); the rows here are already the project's train split, and the held-out
  split is the project's, so the loaders are built on all rows and validation is skipped.

The recipe is speculators' own (Muon on the matrices and AdamW on the rest, its weight decays,
linear schedule with 1% warmup, 8192-token packed rows, KL to the verifier over the draft
vocabulary, 3 TTT steps at equal weight, draft head taken from the verifier's rows and
frozen) but for what is matched to the project's BASE row (``DEFAULTS`` below) and the
layout flags: ``--no-norm-before-fc --no-norm-output --no-norm-before-residual
--full-attention-indices 0`` give the SGLang ``LlamaForCausalLMEagle3`` network, which the
project's drafter and evaluator represent (its defaults add three norms and a 2048-token
sliding window that SGLang's layer does not have).

Prints one JSON line at the end: the checkpoint, wall time, tokens/s, peak RSS, the last
logged training metrics; and writes ``parity.safetensors`` (speculators' own drafts on a few
training rows) for the project side to check its conversion against.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import time
from pathlib import Path

# knobs matched to the project's BASE row (benchmarks/drafter_quality.py); all else is speculators'
DEFAULTS = {"draft_vocab_size": 8192, "ttt_steps": 3, "epochs": 13, "lr": 1e-3}
LAYOUT_FLAGS = ["--no-norm-before-fc", "--no-norm-output", "--no-norm-before-residual", "--full-attention-indices", "0"]
CPU_FLAGS = ["--hidden-states-dtype", "float32", "--loss-implementation", "eager", "--draft-attn-impl", "sdpa",
             "--num-workers", "0", "--on-missing", "raise"]
PARITY_ROWS = 4
# Tokens per packed row (= per optimizer step): speculators' own default. Measured here on 2 cores:
# 8192-token rows 89 s per step (81 tokens/s); 2048-token rows were slower per token (more than
# 35 s per step), so the default stays.
TOTAL_SEQ_LEN = 8192


def prepare_dataset(data: Path) -> dict:
    """speculators' Arrow dataset (``input_ids``, ``loss_mask``, ``seq_len`` as torch tensors) and
    ``token_freq.pt`` (its own counting of loss-masked tokens) from ``rows.jsonl``."""
    import datasets
    import torch
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    rows = [json.loads(line) for line in (data / "rows.jsonl").read_text().splitlines() if line.strip()]
    if [r["index"] for r in rows] != list(range(len(rows))):
        raise ValueError(f"{data}/rows.jsonl: rows are not numbered 0..{len(rows) - 1}")
    for r in rows:
        if not (data / "hidden_states" / f"hs_{r['index']}.safetensors").exists():
            raise FileNotFoundError(f"{data}: hidden states of row {r['index']} are missing")
    ds = datasets.Dataset.from_dict({
        "input_ids": [torch.tensor(r["input_ids"], dtype=torch.long) for r in rows],
        "loss_mask": [torch.tensor(r["loss_mask"], dtype=torch.long) for r in rows],
        "seq_len": [len(r["input_ids"]) for r in rows],
    })
    ds.set_format(type="torch")
    ds.save_to_disk(str(data))
    freq = data / "token_freq.pt"
    freq.unlink(missing_ok=True)  # speculators reuses an existing file without recounting
    for stale in data.glob("[dt]2[td]-*.npy"):
        stale.unlink()  # nor should a cached vocab map of earlier data be reused
    save_token_frequency_distribution(ds, freq)
    return {"rows": len(rows), "tokens": sum(len(r["input_ids"]) for r in rows)}


def apply_cpu_patches() -> dict:
    """The run-time changes that let speculators 0.9.0's trainer run on a CPU-only torch."""
    import speculators.train.trainer as trainer
    import torch

    os.environ.pop("LOCAL_RANK", None)  # the non-distributed path
    patched = {"local_rank": "cpu"}
    trainer.get_local_rank = lambda: "cpu"
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *a, **k: None
        patched["accelerator_synchronize"] = "no-op (no accelerator)"
    return patched


class Collector(logging.Handler):
    """Keeps the trainer's metric records (dicts) as they are logged."""

    def __init__(self):
        super().__init__()
        self.records: list[dict] = []

    def emit(self, record):
        if isinstance(record.msg, dict) and "train" in record.msg:
            self.records.append(record.msg)


def train(args) -> dict:
    import speculators.train.cli as cli
    import torch
    from speculators.train.config import TrainConfig
    from speculators.train.data import ArrowDataset
    from speculators.train.dataloader import _setup_dataloader

    torch.set_num_threads(args.threads)
    data, run, target = args.data.resolve(), args.run.resolve(), args.target.resolve()
    prepared = prepare_dataset(data)
    patched = apply_cpu_patches()

    def all_rows_loaders(*, data_path, total_seq_len, hidden_states_dtype, transfer, hidden_size, num_target_layers,
                         num_workers, prefetch_factor, preprocess, seed=0, on_missing="raise", **_):
        dataset = ArrowDataset(datapath=data_path, max_len=total_seq_len, transfer=transfer, on_missing=on_missing,
                               train_ratio=1.0, split="train", hidden_states_dtype=hidden_states_dtype)
        loader = _setup_dataloader(dataset, total_seq_len, hidden_size, num_workers=num_workers,
                                   num_target_layers=num_target_layers, prefetch_factor=prefetch_factor,
                                   preprocess=preprocess, seed=seed)
        return loader, None

    cli.create_train_val_loaders = all_rows_loaders

    collector = Collector()
    setup_metric_logger = cli.setup_metric_logger

    def setup_metrics(*a, **k):
        setup_metric_logger(*a, **k)
        logging.getLogger("speculators.metrics").addHandler(collector)

    cli.setup_metric_logger = setup_metrics

    timing, kept = {}, {}
    run_training = cli.Trainer.run_training

    def timed_run_training(self):
        kept["model"] = self.model
        kept["steps_per_epoch"] = len(self.train_loader)
        t0 = time.perf_counter()
        try:
            return run_training(self)
        finally:
            timing["train_s"] = time.perf_counter() - t0

    cli.Trainer.run_training = timed_run_training

    epochs = args.epochs if args.epochs is not None else DEFAULTS["epochs"]
    argv = [
        "--verifier-name-or-path", str(target), "--data-path", str(data),
        "--save-path", str(run / "checkpoints"), "--log-dir", str(run / "logs"),
        "--speculator-type", "eagle3", "--target-layer-ids", *map(str, args.target_layer_ids),
        "--draft-vocab-size", str(DEFAULTS["draft_vocab_size"]), "--ttt-steps", str(DEFAULTS["ttt_steps"]),
        "--epochs", str(epochs), "--lr", str(DEFAULTS["lr"]), "--total-seq-len", str(args.total_seq_len),
        "--checkpoint-freq", str(epochs), "--seed", str(args.seed),  # keep the first and the last epoch only
        *LAYOUT_FLAGS, *CPU_FLAGS,
    ]
    if args.max_steps:
        argv += ["--max-steps", str(args.max_steps)]
    cfg = TrainConfig.resolve(argv)
    t0 = time.perf_counter()
    cli.main(cfg)
    wall = time.perf_counter() - t0

    ckpts = sorted((p for p in (run / "checkpoints").iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    last_epoch = ckpts[-1]
    model = kept["model"]
    if args.max_steps:  # a smoke run stops mid-epoch, after its checkpoint: save what it trained
        last_epoch = run / "checkpoints" / "final"
        model.save_pretrained(str(last_epoch))
    parity = write_parity(model, last_epoch, data, run / "parity.safetensors", DEFAULTS["ttt_steps"])

    steps = [r for r in collector.records if "train" in r]
    tokens = sum(r["profile"]["tokens_per_s"] * r["profile"]["step_ms"] / 1000 for r in steps if r.get("profile"))
    last = steps[-1]["train"] if steps else {}
    return {
        "checkpoint": str(last_epoch), "speculators": _version("speculators"), "torch": torch.__version__,
        "argv": argv, "cpu_patches": patched, "data": prepared, "epochs": epochs, "max_steps": args.max_steps,
        "optimizer_steps": len(steps), "steps_per_epoch": kept.get("steps_per_epoch"),
        "trained_tokens": round(tokens), "train_s": round(timing.get("train_s", wall), 1), "wall_s": round(wall, 1),
        "tokens_per_s": round(tokens / timing["train_s"], 1) if timing.get("train_s") else None,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "threads": args.threads, "total_seq_len": args.total_seq_len,
        "last_metrics": {k: round(float(v), 4) for k, v in last.items()},
        "first_metrics": {k: round(float(v), 4) for k, v in (steps[0]["train"] if steps else {}).items()},
        "parity_rows": parity,
    }


def write_parity(model, checkpoint: Path, data: Path, out: Path, ttt_steps: int) -> int:
    """speculators' own drafts (draft-vocabulary ids, every TTT step) on the first rows, by its
    model holding the weights as saved in ``checkpoint`` (bf16 there), for the project side to
    compare its rebuilt drafter with (``reference_convert.draft_agreement``)."""
    import torch
    from safetensors.torch import load_file, save_file

    saved = load_file(str(checkpoint / "model.safetensors"))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in saved.items()}, strict=False)
    if unexpected or any(not k.startswith("verifier_") for k in missing):
        raise ValueError(f"{checkpoint}: saved weights do not fit the model: {missing} {unexpected}")
    model = model.float().eval()
    tensors = {}
    n = 0
    for i in range(PARITY_ROWS):
        path = data / "hidden_states" / f"hs_{i}.safetensors"
        if not path.exists():
            break
        hs = load_file(str(path))
        ids, states = hs["token_ids"].long(), hs["hidden_states"].float()
        aux = states[:, :3].flatten(1)
        t = ids.shape[0]
        with torch.no_grad():  # its shifted batch: token t + 1 with the features of token t
            drafts = model(hidden_states=aux[None, :-1], input_ids=ids[None, 1:],
                           document_ids=torch.zeros(1, t - 1, dtype=torch.long),
                           position_ids=torch.arange(1, t)[None], ttt_steps=ttt_steps)
        tensors.update({f"input_ids.{i}": ids, f"aux.{i}": aux, f"steps.{i}": torch.tensor(ttt_steps),
                        f"draft_ids.{i}": torch.stack([d[0] for d in drafts])})
        n += 1
    tensors["count"] = torch.tensor(n)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out))
    return n


def _version(dist: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(dist)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="what reference_convert.to_speculators wrote")
    ap.add_argument("--run", type=Path, required=True, help="checkpoints, logs and parity file go here")
    ap.add_argument("--target", type=Path, required=True, help="the verifier, in Hugging Face format")
    ap.add_argument("--target-layer-ids", type=int, nargs=3, required=True, help="aux ids, vLLM's numbering")
    ap.add_argument("--epochs", type=int, default=None, help=f"default {DEFAULTS['epochs']} (the BASE row's)")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps (a smoke run)")
    ap.add_argument("--total-seq-len", type=int, default=TOTAL_SEQ_LEN,
                    help=f"tokens per packed row and optimizer step (speculators' default, {TOTAL_SEQ_LEN})")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args(argv)
    for k, v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(k, v)
    result = train(args)
    sys.stdout.flush()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
