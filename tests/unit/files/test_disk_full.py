"""A disk that fills, for real (a small tmpfs mounted by the test, marked ``mount``), wherever the
project writes: token and corpus tables, hidden-state shards, checkpoints, exports (the spool's are
in tests/unit/drafter/test_streaming_faults.py). Before a write, what it will take is compared with
the free space and refused naming the folder and both figures; a write that still runs out of space
fails at once naming the file, removes its temporary file, and leaves what was there before whole.
"""

from pathlib import Path

import polars as pl
import pytest
import torch

from eagle3_assets.files import DiskFull, InsufficientDiskSpace, atomic_path, free_bytes, write_parquet_atomic
from tests.support.small_fs import fill, small_filesystem
from tests.support.streaming import EchoCapture, make_mixed_corpora

pytestmark = pytest.mark.mount

MB = 1 << 20


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in Path(folder).rglob(".*tmp*"))


def token_rows(n: int, length: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"sample_id": f"s{i}", "dataset": "d", "prompt_id": f"p{i}", "sample_index": 0, "source": "local",
             "input_ids": torch.randint(0, 49152, (length,), generator=g).tolist(), "loss_mask": [1] * length,
             "prompt_len": 1, "completion_len": length - 1, "native_ids": True} for i in range(n)]


@pytest.mark.parametrize("table", ["tokens", "corpus"])
def test_a_table_too_big_for_the_disk_is_refused_naming_the_folder_and_both_figures(tmp_path, table):
    from eagle3_assets.tokens.table import write_token_table

    with small_filesystem(tmp_path / "fs", 1 * MB) as fs:
        path = fs / table / "d.parquet"
        if table == "tokens":
            write_token_table(token_rows(4, 50), path)
        else:
            write_parquet_atomic(pl.DataFrame({"sample_id": ["a"], "input_ids": [[1, 2, 3]]}), path)
        before = path.read_bytes()
        with pytest.raises(InsufficientDiskSpace) as err:
            if table == "tokens":
                write_token_table(token_rows(400, 2000), path)  # 800,000 random ids: about 1.7 MB in the file
            else:
                write_parquet_atomic(pl.DataFrame([{k: r[k] for k in ("sample_id", "input_ids")}
                                                   for r in token_rows(400, 2000)]), path)
        message = str(err.value)
        assert f"not enough disk for d.parquet at {path.parent}: need " in message and f"only {free_bytes(fs):,} free" in message
        assert path.read_bytes() == before and not leftovers(fs)


def test_a_write_that_runs_out_of_space_names_the_file_and_keeps_the_old_one(tmp_path):
    with small_filesystem(tmp_path / "fs", 1 * MB) as fs:
        path = fs / "result.json"
        path.write_text('{"old": true}')
        with pytest.raises(DiskFull, match=rf"disk full writing {path}: No space left on device; \d[\d,]* bytes free"):
            with atomic_path(path) as tmp, open(tmp, "wb") as fh:
                for _ in range(4):
                    fh.write(b"x" * MB)
                    fh.flush()
        assert path.read_text() == '{"old": true}' and not leftovers(fs)


class FillsAfter(EchoCapture):
    """Something else fills the disk once ``after`` batches are captured."""

    def __init__(self, folder: Path, after: int):
        self.folder, self.after, self.calls = folder, after, 0

    def extract(self, rows):
        self.calls += 1
        if self.calls == self.after + 1:
            fill(self.folder)
        return super().extract(rows)


def test_shards_a_disk_that_fills_mid_extraction_fails_naming_the_shard_and_a_rerun_resumes(tmp_path):
    from eagle3_assets.hidden_states.extract import extract_corpus, verify_shards

    corpus = make_mixed_corpora(tmp_path / "corpus")["a"]
    with small_filesystem(tmp_path / "fs", 3 * MB) as fs:
        out = fs / "hs"
        with pytest.raises(DiskFull, match=rf"disk full writing {out}/shard-000\d\d\.safetensors"):
            extract_corpus(corpus, out, FillsAfter(fs, after=5), batch_tokens=1, shard_bytes=100, disk_margin=0.0,
                           background_writes=True)
        kept = sorted(p.name for p in out.glob("shard-*.safetensors"))
        assert kept and not leftovers(fs)  # the shards written before the disk filled are there, recorded
        (fs / "ballast").unlink()
        report = extract_corpus(corpus, out, EchoCapture(), batch_tokens=1, shard_bytes=100, disk_margin=0.0)
        assert report.already_done >= len(kept) and verify_shards(out, corpus).ok


def test_checkpoints_refused_up_front_and_a_full_disk_keeps_the_last_one(tmp_path):
    from eagle3_assets.drafter.training.checkpoints import latest_checkpoint, require_room, save_checkpoint, state_bytes

    with small_filesystem(tmp_path / "fs", 2 * MB) as fs:
        out = fs / "drafter"
        model = torch.nn.Linear(512, 512)  # 1 MB of float32 weights: 4 checkpoints of it do not fit
        with pytest.raises(InsufficientDiskSpace, match=rf"the training's checkpoints and exports at {out}: need [\d,]+"):
            require_room(out, model, keep=2, exports=1)
        small = {"step": 1, "model": {"w": torch.zeros(1000)}}
        first = save_checkpoint(out, small, keep=2)
        big = {"step": 2, "model": {"w": torch.zeros(600_000)}}  # 2.4 MB
        with pytest.raises(InsufficientDiskSpace, match=rf"a training checkpoint at {out}/checkpoints: need 2,400,000"):
            save_checkpoint(out, big, keep=2)
        fill(fs, leave=state_bytes(small) + 256)  # the estimate passes; torch.save's own frame does not fit
        with pytest.raises(DiskFull, match=rf"disk full writing {out}/checkpoints/step-00000003\.pt"):
            save_checkpoint(out, {**small, "step": 3}, keep=2)
        assert latest_checkpoint(out) == first and torch.load(first)["step"] == 1 and not leftovers(fs)


def test_an_export_too_big_for_the_disk_is_refused_and_the_old_export_stays(tmp_path):
    from eagle3_assets.drafter.export_files import write_dir_atomic

    with small_filesystem(tmp_path / "fs", 1 * MB) as fs:
        export = fs / "drafters" / "demo" / "sglang"
        write_dir_atomic(export, {"config.json": {"a": 1}, "model.safetensors": {"w": torch.ones(10)}})
        with pytest.raises(InsufficientDiskSpace, match=rf"the export sglang at {export.parent}: need 2,000,000 bytes"):
            write_dir_atomic(export, {"config.json": {"a": 2}, "model.safetensors": {"w": torch.ones(500_000)}})
        assert (export / "config.json").read_text().strip().startswith('{\n  "a": 1') and not leftovers(fs)
