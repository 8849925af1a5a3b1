"""What the streaming tests share: small corpora, job files, real subprocesses, a spool sampler,
a stand-in capture engine.

``make_corpus`` has strictly decreasing lengths; ``make_mixed_corpora`` two datasets of mixed
lengths, ties included, in no order of length: the offline loader and the plan must agree on the
order without the corpus's help. For bits to agree, every forward batch holds one row
(``batch_tokens`` below twice the shortest sample: 48 for ``make_corpus``, 1 for the mixed
corpora), so a sample's states do not depend on which samples share its batch; with more rows a
batch they agree to bf16 rounding (docs/streaming.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import polars as pl
import torch

from eagle3_assets.drafter.training.config import DraftShape, RuntimeSettings, TrainJob, TrainSettings
from eagle3_assets.hidden_states.spool.produce import ProducerJob
from eagle3_assets.hidden_states.spool.settings import StreamSettings
from eagle3_assets.paths import REPO_ROOT
from eagle3_assets.target.ref import TargetRef

DRAFT_VOCAB = 512
LAYER_IDS = [1, 14, 26]


def make_corpus(path: Path, n: int = 12, longest: int = 48, seed: int = 0) -> Path:
    """``n`` train samples of strictly decreasing lengths, random ids of the target's vocabulary."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        t = longest - 2 * i
        rows.append({"sample_id": f"s{i:03d}", "split": "train", "input_ids": torch.randint(3, 49152, (t,), generator=g).tolist(),
                     "loss_mask": [0] * (t // 3) + [1] * (t - t // 3)})
    path.parent.mkdir(parents=True, exist_ok=True)
    pl.DataFrame(rows, schema_overrides={"input_ids": pl.List(pl.Int32), "loss_mask": pl.List(pl.Int8)}).write_parquet(path)
    return path


MIXED_LENGTHS = {"a": [31, 12, 48, 31, 7, 40, 19], "b": [25, 44, 25, 9, 36]}


def make_mixed_corpora(folder: Path, seed: int = 0, lengths: dict | None = None) -> dict[str, Path]:
    """Two datasets' corpora (``a``: 7 train samples, ``b``: 5) of mixed lengths with ties, rows in no
    order of length, sample ids not in row order either: dataset name -> parquet."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, lens in (lengths or MIXED_LENGTHS).items():
        rows = []
        for i, t in enumerate(lens):
            rows.append({"sample_id": f"{name}{(7 * i + 3) % 11:02d}", "split": "train",
                         "input_ids": torch.randint(3, 49152, (t,), generator=g).tolist(),
                         "loss_mask": [0] * (t // 3) + [1] * (t - t // 3)})
        out[name] = folder / f"{name}.parquet"
        folder.mkdir(parents=True, exist_ok=True)
        pl.DataFrame(rows, schema_overrides={"input_ids": pl.List(pl.Int32), "loss_mask": pl.List(pl.Int8)}
                     ).write_parquet(out[name])
    return out


class EchoCapture:
    """A stand-in capture engine: states a function of the ids (hidden size 8), no model, no forward."""

    hidden_size, vocab_size = 8, 49152

    def describe(self):
        from eagle3_assets.target import layers as hidden_layers

        return {"target": {"name": "echo", "revision": None, "config_sha256": "0"},
                "layers": hidden_layers.convention(LAYER_IDS, 30), "backend": "echo"}

    def extract(self, rows):
        from eagle3_assets.engines.roles import Features

        out = []
        for r in rows:
            base = torch.tensor(r, dtype=torch.float32).unsqueeze(1) / 49152
            out.append(Features(base * torch.linspace(-3, 3, 3 * self.hidden_size),
                                base * torch.linspace(-1, 1, self.hidden_size)))
        return out


def training(**kw) -> TrainSettings:
    base = dict(epochs=1.0, batch_size=3, ttt_steps=2, lr=3e-3, warmup_steps=1, checkpoint_every=2, max_length=64,
                feature_noise=0.0, keep_checkpoints=1)
    return TrainSettings(**{**base, **kw})


def stream_settings(spool: Path, corpus: Path, **kw) -> StreamSettings:
    base = dict(spool_dir=str(spool), corpora={str(corpus): 1.0}, cap_bytes=3 << 20, unit_bytes=600_000,
                layer_ids=LAYER_IDS, batch_tokens=48, poll_s=0.02)
    return StreamSettings(**{**base, **kw})


def train_job(model_dir: Path, out: Path, *, stream: StreamSettings | None = None, datasets: dict | None = None,
              settings: TrainSettings | None = None, shape: DraftShape | None = None) -> TrainJob:
    """A CPU training job on ``model_dir``; ``shape`` defaults to SmolLM2's small Llama drafter."""
    return TrainJob(target=TargetRef(model_dir=str(model_dir)), out_dir=str(out), datasets=datasets or {}, stream=stream,
                    training=settings or training(),
                    shape=shape or DraftShape(draft_vocab_size=DRAFT_VOCAB, intermediate_size=256, aux_layer_ids=LAYER_IDS),
                    runtime=RuntimeSettings(threads=1, progress=False, device="cpu"))


def producer_job(spool: Path, model_dir: Path, name: str = "p0") -> ProducerJob:
    return ProducerJob(spool_dir=str(spool), target=TargetRef(model_dir=str(model_dir)), device="cpu", model_dtype="float32",
                       threads=1, name=name, poll_s=0.02, heartbeat_s=0.5)


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_PIPES")}
    e.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return e


def spawn_producer(job_path: Path, log: Path, *extra: str, python: str = sys.executable,
                   environ: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([python, "-m", "eagle3_assets.hidden_states.spool", "--config", str(job_path), *extra],
                            env=environ or env(), cwd=REPO_ROOT, stdout=open(log, "a"), stderr=subprocess.STDOUT)


def spawn_trainer(job_path: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "eagle3_assets.drafter.training", "--config", str(job_path)],
                            env=env(), cwd=REPO_ROOT, stdout=open(log, "a"), stderr=subprocess.STDOUT)


def filesystem_bytes(root: Path) -> int:
    """Every file's size under ``root``, read here from the filesystem (not the spool's own count).

    A file is counted once by its inode: the spool publishes and deletes units by renaming their
    folders, and a walk that meets a folder before and after its rename would count it twice."""
    sizes: dict[tuple[int, int], int] = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except FileNotFoundError:
                continue
            sizes[(st.st_dev, st.st_ino)] = st.st_size
    return sum(sizes.values())


class Sampler:
    """Samples the spool's bytes from the filesystem every ``every_s`` seconds; ``peak`` is the most seen."""

    def __init__(self, root: Path, every_s: float = 0.01):
        self.root, self.peak, self.samples = Path(root), 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def _run(self, every_s):
        while not self._stop.is_set():
            if self.root.exists():
                self.peak = max(self.peak, filesystem_bytes(self.root))
                self.samples += 1
            time.sleep(every_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def wait_for(cond, timeout: float, what: str, procs=()):
    deadline = time.monotonic() + timeout
    while not cond():
        for p in procs:
            if p.poll() not in (None, 0):
                raise AssertionError(f"{what}: a process ended with {p.poll()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def cursor_step(spool: Path) -> int:
    try:
        return json.loads((spool / "cursor.json").read_text()).get("step") or 0
    except (OSError, ValueError):
        return 0


def captured_units(spool: Path) -> list[dict]:
    path = spool / "captures.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def engine_producer_setup(tmp_path: Path):
    """A 12-sample corpus and its spool planned for one epoch of 4 steps (SmolLM2's 30 layers, width
    576), as an engine's producer test starts: ``(corpus, spool, settings, train, plan)``."""
    from eagle3_assets.drafter.training.stream import open_stream

    corpus = make_corpus(tmp_path / "corpus.parquet")
    spool = tmp_path / "spool"
    settings = stream_settings(spool, corpus, cap_bytes=8 << 20)
    train = training()
    open_stream(settings, train, rank=0, world=1, target_config={"num_hidden_layers": 30, "hidden_size": 576})
    return corpus, spool, settings, train, json.loads((spool / "plan.json").read_text())


def published_samples(spool: Path) -> dict:
    """Sample id -> the sample as its published unit holds it (read back with the shard reader)."""
    from eagle3_assets.hidden_states.reader import ShardReader

    stored = {}
    for unit in (spool / "units").iterdir():
        with ShardReader(unit) as reader:
            for s in reader.iter_samples():
                stored[s.sample_id] = s
    return stored


def assert_each_sample_trained_once(train_dir: Path, spool: Path, corpus: Path, steps: int) -> None:
    """From the trainer's own step records (its last checkpoint) and the captures journal, against the
    corpus parquet: every sample trained once and published, finite losses, the spool's folders empty."""
    from eagle3_assets.drafter.training.checkpoints import latest_checkpoint, load_checkpoint

    state = load_checkpoint(latest_checkpoint(train_dir))
    assert state["step"] == steps
    trained = [k for m in state["metrics"] for k in m["consumed"]["ids"]]
    corpus_ids = pl.read_parquet(corpus)["sample_id"].to_list()
    assert sorted(trained) == [f"0:{s}" for s in sorted(corpus_ids)]  # each sample once
    assert all(m["loss"] == m["loss"] for m in state["metrics"])  # finite losses
    assert not [p for d in ("units", "leases", "tmp") if (spool / d).exists() for p in (spool / d).iterdir()]
    assert sorted(s for c in captured_units(spool) for s in c["samples"]) == sorted(corpus_ids)


@contextlib.contextmanager
def producers_as_the_step_starts_them(out: Path, model_dir: Path, settings: StreamSettings, **stream):
    """Producers started as ``drafter_checkpoint`` starts them for a config ``stream: {...}``: its
    ``StreamRun`` through the real local launcher, with the target resource on CPU (float32, one
    thread) and the resources an engine's extract role reads; the producers end when the run is done."""
    from eagle3_assets.drafter.assets import StreamingConfig
    from eagle3_assets.drafter.stream_run import StreamRun
    from eagle3_assets.launchers import LocalLauncher
    from eagle3_assets.resources import SlurmResource, TargetResource, VLLMResource

    target = TargetResource(model=str(model_dir), device="cpu", dtype="float32", threads=1)
    resources = SimpleNamespace(target=target, vllm=VLLMResource(), slurm=SlurmResource())
    context = SimpleNamespace(log=logging.getLogger("eagle3.stream"))
    with StreamRun(context, settings, target, out, LocalLauncher(), "eagle3-stream-producer-test",
                   StreamingConfig(**stream), resources) as run:
        yield run


def producer_log(run) -> str:
    """Every producer's output so far (each started one's log file), for a failure's message."""
    return "\n".join(s.log.read_text()[-3000:] for s in [*run.ended, *run.started] if s.log.exists())
