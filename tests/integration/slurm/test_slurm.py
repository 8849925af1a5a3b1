"""The GPU stages as jobs on a real SLURM (Debian's slurm-wlm: munged, slurmctld and slurmd started
for the session on this machine's one node), with the real model on CPU.

One data root for the module: a tiny corpus, its hidden states extracted as a SLURM job (compared
with the same extraction in this process), a drafter trained as a 2-task DDP job (compared with
the local 2-process torchrun), cancelled with ``scancel`` mid-training and relaunched, and a run
terminated from Dagster's side (``dagster dev``, GraphQL) while its job first pends and then runs.
Scale: 8 prompts and a few hundred tokens, where a cluster job extracts millions of sequences on
8 GPUs a node; the scheduler's part (submit, pend, run, end, cancel, the shared-filesystem reader)
is the same.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time

import dagster as dg
import pytest
import torch

from eagle3_assets.engines.vllm.server import vllm_available
from eagle3_assets.slurm import scheduler
from tests.conftest import small_prompts, write_jsonl
from tests.support.dagster_helpers import checks_by_name, run_dataset

pytestmark = [pytest.mark.slurm, pytest.mark.model]

DATASET = "qa"
RECIPE = "demo"  # the bundled name (a static partition), overridden by the data root's recipes/demo.toml
TEST_RECIPE = """
description = "SLURM tests: one tiny dataset"
draft_vocab_size = 512
intermediate_size = 256
ttt_steps = 2
lr = 3e-3
warmup_steps = 1
max_steps = 16
batch_size = 2
max_length = 64
seed = 0
checkpoint_every = 2
acceptance_floor = 1.0
eval_max_new_tokens = 4
eval_samples = 2
speculative_k = 2

[datasets]
qa = 1.0
"""
FAST = {"slurm": {"config": {"poll_interval_s": 0.5}}}  # resource overrides: poll squeue twice a second
TRAIN_ON_SLURM = {"launcher": "slurm", "threads": 1, "nproc_per_node": 1, "slurm": {"tasks_per_node": 2}}


def _failures(result) -> list[str]:
    """Each failed step's error (for a SLURM job: the description with its state and log tail)."""
    return [e.step_failure_data.error.message for e in result.all_events if e.event_type_value == "STEP_FAILURE"]


def _materialize(instance, asset: str, partition: str, config: dict, **resources):
    from eagle3_assets.definitions import ALL_ASSETS, ALL_CHECKS, default_resources
    from eagle3_assets.resources import SlurmResource

    res = {**default_resources(), "slurm": SlurmResource(poll_interval_s=0.5), **resources}
    return dg.materialize([*ALL_ASSETS, *ALL_CHECKS], selection=[asset], partition_key=partition, instance=instance,
                          resources=res, raise_on_error=False, run_config={"ops": {asset: {"config": config}}})


@contextlib.contextmanager
def corpus_root(tmp_path_factory, name: str):
    """A data root with the corpus of one dataset (half held out, for the drafter's evaluation)."""
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.resources import DatasetSettings

    layout = DataLayout(tmp_path_factory.mktemp(name) / "data")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLE3_HOME", str(layout.root))
        mp.setenv("OMP_NUM_THREADS", "1")  # forwarded to the jobs: two tasks share the two cores
        write_jsonl(layout.prompt_source(DATASET), small_prompts(8))
        (layout.root / "recipes").mkdir(parents=True)
        (layout.root / "recipes" / f"{RECIPE}.toml").write_text(TEST_RECIPE)
        with dg.instance_for_test() as instance:
            assert run_dataset(instance, DATASET, resources={"dataset_settings": DatasetSettings(eval_fraction=0.5)}).success
            yield layout, instance


@pytest.fixture(scope="module")
def root(slurm_cluster, model_dir, tmp_path_factory):
    with corpus_root(tmp_path_factory, "slurm-data") as r:
        yield r


@pytest.fixture(scope="module")
def extracted(root):
    layout, instance = root
    result = _materialize(instance, "hidden_states", DATASET, {"launcher": "slurm"})
    assert result.success, _failures(result)
    return result


def _messages(instance, run_id: str) -> list[str]:
    return [rec.user_message or "" for rec in instance.all_logs(run_id)]


def test_extraction_as_a_slurm_job_equals_local_extraction(root, extracted, slurm_cluster, model_dir, tmp_path):
    from eagle3_assets.engines.local.extractor import LocalExtractor
    from eagle3_assets.hidden_states.extract import extract_corpus
    from eagle3_assets.hidden_states.reader import ShardReader

    layout, instance = root
    assert checks_by_name(extracted)["shard_integrity"].passed
    meta = {k: v.value for k, v in extracted.asset_materializations_for_node("hidden_states")[0].metadata.items()}
    assert meta["slurm_state"] == "COMPLETED" and meta["slurm_exit_code"] == "0:0"
    assert meta["slurm_nodes"] == slurm_cluster.node and meta["slurm_tasks"] == 1
    assert meta["slurm_elapsed_s"] > 0 and meta["slurm_job_id"].isdigit()
    # the scheduler's own record of the job, not the step's
    assert scheduler.scontrol_job(meta["slurm_job_id"])["JobState"] == "COMPLETED"
    logs = _messages(instance, extracted.run_id)
    assert any(m.startswith(f"submitted SLURM job {meta['slurm_job_id']}") for m in logs)
    assert any(m.startswith("extracted 8 samples") for m in logs)  # a Pipes message from the job, read off the file
    assert meta["extracted_now"] == 8

    # Bit equality is the claim, so this side runs with the job's one thread (OMP_NUM_THREADS=1 above):
    # a matmul's reduction order, and so its last bits, follows the thread count, which is the machine's.
    local = tmp_path / "local"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        extract_corpus(layout.corpus(DATASET), local, LocalExtractor(model_dir), batch_tokens=4096)
    finally:
        torch.set_num_threads(threads)
    on_slurm, here = ShardReader(layout.hidden_states_dir(DATASET)), ShardReader(local)
    assert sorted(on_slurm.sample_ids()) == sorted(here.sample_ids()) and len(here.sample_ids()) == 8
    for sid in here.sample_ids():
        a, b = on_slurm.read(sid), here.read(sid)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.aux_hidden, b.aux_hidden) and torch.equal(a.last_hidden, b.last_hidden), sid


def test_sglang_extraction_as_a_two_rank_job_across_two_tasks(root, extracted, monkeypatch):
    """backend sglang: torchrun under srun, one rank per task (as one rank per node would be),
    with the transformers stand-in for SGLang's capture on each rank; it writes what the
    single-process SLURM extraction wrote, bit for bit."""
    from eagle3_assets.hidden_states.reader import ShardReader

    layout, instance = root
    monkeypatch.setenv("EAGLE3_SGLANG_CAPTURE", "tests.support.capture:local_capture")  # forwarded to the job
    instance.add_dynamic_partitions("datasets", ["qa_tp"])
    shutil.copy(layout.corpus(DATASET), layout.corpus("qa_tp"))
    result = _materialize(instance, "hidden_states", "qa_tp",
                          {"launcher": "slurm", "backend": "sglang", "tp_size": 2, "slurm": {"tasks_per_node": 2}})
    assert result.success, _failures(result)
    meta = {k: v.value for k, v in result.asset_materializations_for_node("hidden_states")[0].metadata.items()}
    assert (meta["slurm_state"], meta["slurm_tasks"], meta["extracted_now"]) == ("COMPLETED", 2, 8)
    ranks = [(layout.hidden_states_dir("qa_tp").parent / f"qa_tp.rank{r}.jsonl").read_text() for r in range(2)]
    assert ranks[0] == ranks[1] and ranks[0]  # both ranks ran every forward
    two, one = ShardReader(layout.hidden_states_dir("qa_tp")), ShardReader(layout.hidden_states_dir(DATASET))
    assert sorted(two.sample_ids()) == sorted(one.sample_ids())
    for sid in one.sample_ids():
        assert torch.equal(two.read(sid).aux_hidden, one.read(sid).aux_hidden), sid


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="no vLLM environment (.venv-vllm): run `make vllm` to run this")
def test_vllm_extraction_with_the_server_started_inside_the_job(root, extracted):
    """backend vllm: the job starts a vLLM extraction server on its node, extracts through it and
    stops it; the states equal the local extraction's to bf16 precision (as in test_vllm_extraction)."""
    from eagle3_assets.hidden_states.reader import ShardReader

    layout, instance = root
    instance.add_dynamic_partitions("datasets", ["qa_vllm"])
    shutil.copy(layout.corpus(DATASET), layout.corpus("qa_vllm"))
    result = _materialize(instance, "hidden_states", "qa_vllm", {"launcher": "slurm", "backend": "vllm"})
    assert result.success, _failures(result)
    meta = {k: v.value for k, v in result.asset_materializations_for_node("hidden_states")[0].metadata.items()}
    assert (meta["slurm_state"], meta["extracted_now"]) == ("COMPLETED", 8)
    log = open(meta["slurm_log"]).read()
    assert "vLLM extraction server ready: http://127.0.0.1:" in log
    manifest = json.loads((layout.hidden_states_dir("qa_vllm") / "manifest.json").read_text())
    assert manifest["backend"]["name"] == "vllm"
    got, want = ShardReader(layout.hidden_states_dir("qa_vllm")), ShardReader(layout.hidden_states_dir(DATASET))
    for sid in want.sample_ids():
        a, b = got.read(sid), want.read(sid)
        assert torch.equal(a.input_ids, b.input_ids)
        for x, y in ((a.aux_hidden, b.aux_hidden), (a.last_hidden, b.last_hidden)):
            err = ((x.float() - y.float()).norm(dim=-1) / y.float().norm(dim=-1).clamp_min(1e-6)).max()
            assert err < 1e-2, (sid, float(err))


def test_a_failing_job_fails_the_step_with_its_state_and_log_tail(root):
    layout, instance = root
    instance.add_dynamic_partitions("datasets", ["broken"])
    layout.corpus("broken").write_bytes(b"not parquet")  # fails inside the job, where it reads the corpus
    result = _materialize(instance, "hidden_states", "broken", {"launcher": "slurm"})
    assert not result.success
    [message] = _failures(result)
    assert "failed (a task exited non-zero): state FAILED, exit code 1:0" in message, message
    assert "Last lines of" in message and "Traceback" in message and "load_corpus" in message  # the job's own
    assert not scheduler.live_jobs_named("eagle3-hidden_states-broken")


def _checkpoint(out):
    from eagle3_assets.drafter.training.checkpoints import latest_checkpoint, load_checkpoint

    return load_checkpoint(latest_checkpoint(out))


@pytest.fixture(scope="module")
def trained(root, extracted):
    layout, instance = root
    result = _materialize(instance, "drafter_checkpoint", RECIPE, TRAIN_ON_SLURM)
    assert result.success, _failures(result)
    out = layout.drafter_dir(RECIPE)
    saved = layout.root / "drafter-uninterrupted"
    shutil.copytree(out, saved)
    return result, saved


def test_training_as_a_two_task_job_equals_the_local_two_process_run(root, trained, tmp_path):
    result, saved = trained
    meta = {k: v.value for k, v in result.asset_materializations_for_node("drafter_checkpoint")[0].metadata.items()}
    assert meta["slurm_state"] == "COMPLETED" and meta["slurm_tasks"] == 2
    assert meta["world_size"] == 2 and meta["steps"] == 16  # reported by rank 0 through Pipes
    log = (saved.parent / "slurm").glob(f"drafter_checkpoint/{RECIPE}/*/slurm-{meta['slurm_job_id']}.out")
    assert "2 task(s)" in next(log).read_text()

    assert_equals_two_local_processes(saved, tmp_path)


def assert_equals_two_local_processes(saved, tmp_path) -> None:
    """The job's checkpoint equals, bit for bit, the same job run here by a 2-process torchrun (the
    same global batch; a two-rank all-reduce adds the same two tensors either way)."""
    import os
    import subprocess
    import sys

    from eagle3_assets.drafter.training.config import TrainJob
    from eagle3_assets.paths import REPO_ROOT

    job = TrainJob.from_json(saved / "job.json")
    local_job = job.model_copy(update={"out_dir": str(tmp_path / "local"), "pipes_asset_key": None})
    path = local_job.write(tmp_path / "local.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_PIPES")} | {"OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "-m", "eagle3_assets.drafter.training", "--config", str(path)],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    a, b = _checkpoint(saved), _checkpoint(tmp_path / "local")
    assert a["step"] == b["step"] == 16 and a["world_size"] == b["world_size"] == 2
    for name, t in a["model"].items():
        assert torch.equal(t, b["model"][name]), name
    assert [m["loss"] for m in a["metrics"]] == [m["loss"] for m in b["metrics"]]


def after_first_checkpoint(out, act) -> tuple[threading.Thread, dict]:
    """A watcher that calls ``act(job_id)`` once the training job under ``out`` wrote its first
    checkpoint; the dict gets the job id and the moment (``job``, ``at``)."""
    record: dict = {}

    def watch():
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and not (out / "checkpoints" / "latest").exists():
            time.sleep(0.05)
        jobs = scheduler.live_jobs_named(f"eagle3-drafter_checkpoint-{RECIPE}")
        if jobs:
            record["job"], record["at"] = jobs[0].job_id, time.monotonic()
            act(jobs[0].job_id)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    return watcher, record


def test_scancel_mid_training_then_relaunch_resumes(root, trained):
    layout, instance = root
    _, saved = trained
    out = layout.drafter_dir(RECIPE)
    shutil.rmtree(out)
    watcher, cancelled = after_first_checkpoint(out, scheduler.scancel)
    first = _materialize(instance, "drafter_checkpoint", RECIPE, TRAIN_ON_SLURM)
    watcher.join(60)
    assert cancelled, "the job ended before it could be cancelled"
    assert not first.success
    [message] = _failures(first)
    assert f"SLURM job {cancelled['job']} cancelled" in message and "state CANCELLED" in message, message
    assert "Last lines of" in message
    assert scheduler.scontrol_job(cancelled["job"])["JobState"] == "CANCELLED"
    kept = _checkpoint(out)
    assert 2 <= kept["step"] < 16  # stopped between its first checkpoint and the end

    second = _materialize(instance, "drafter_checkpoint", RECIPE, TRAIN_ON_SLURM)
    assert second.success, _failures(second)
    final, uninterrupted = _checkpoint(out), _checkpoint(saved)
    assert final["step"] == 16
    # the relaunch continued from the kept checkpoint: its first steps are the cancelled job's, as recorded then
    assert final["metrics"][: kept["step"]] == kept["metrics"]
    for name_, t in final["model"].items():  # and ended where the uninterrupted job ended
        assert torch.equal(t, uninterrupted["model"][name_]), name_


def _wait_for_log(instance, run_id: str, needle: str, timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for m in _messages(instance, run_id):
            if needle in m:
                return m
        time.sleep(0.5)
    last = _messages(instance, run_id)[-10:]
    raise AssertionError(f"no log line with {needle!r} in run {run_id} after {timeout:.0f} s: {last}")


def test_terminating_the_run_from_dagster_cancels_a_pending_then_running_job(root, trained, slurm_cluster):
    """``dagster dev`` on the module's data root; a run's job waits behind a job holding the node
    (pending, reason Resources) and *Terminate* over GraphQL cancels it there, before it ever ran;
    a second run's job waits, then runs, and *Terminate* cancels it while running."""
    from tests.support.dagster_dev import dagster_dev

    layout, other_instance = root
    blocker = slurm_cluster.run("sbatch", "--parsable", f"--ntasks={slurm_cluster.cpus}", "-J", "blocker",
                                "-o", "/dev/null", "--wrap", "sleep 600").stdout.strip()
    run_config = {"ops": {"drafter_checkpoint": {"config": TRAIN_ON_SLURM}}, "resources": FAST}
    with dagster_dev(layout.root) as running:
        server, instance = running.server, running.instance
        # terminated while pending: the job is cancelled in the queue and never starts
        run_id = server.launch_run(["drafter_checkpoint"], run_config, {"dagster/partition": RECIPE})
        pending = _wait_for_log(instance, run_id, "is pending (")
        held = pending.split()[2]
        assert scheduler.scontrol_job(held)["JobState"] == "PENDING"
        server.terminate_run(run_id)
        assert server.wait_for_run(run_id, timeout=300, poll=1.0) == "CANCELED"
        assert any(f"cancelled SLURM job {held} with scancel" in m for m in _messages(instance, run_id))
        assert not any(f"SLURM job {held} is running" in m for m in _messages(instance, run_id))
        record = scheduler.scontrol_job(held)
        assert record["JobState"] == "CANCELLED" and record.get("RunTime") == "00:00:00", record
        # terminated while running
        run_id = server.launch_run(["drafter_checkpoint"], run_config, {"dagster/partition": RECIPE})
        pending = _wait_for_log(instance, run_id, "is pending (")
        assert "(Resources)" in pending or "(Priority)" in pending, pending
        job_id = pending.split()[2]
        # a second launch for the same recipe is refused while the job lives
        refused = _materialize(other_instance, "drafter_checkpoint", RECIPE, TRAIN_ON_SLURM)
        assert not refused.success and f"SLURM job {job_id} (PENDING" in _failures(refused)[0]
        scheduler.scancel(blocker)
        _wait_for_log(instance, run_id, f"SLURM job {job_id} is running on {slurm_cluster.node}")
        server.terminate_run(run_id)
        assert server.wait_for_run(run_id, timeout=300, poll=1.0) == "CANCELED"
        assert any(f"cancelled SLURM job {job_id} with scancel" in m for m in _messages(instance, run_id))
    assert scheduler.scontrol_job(job_id)["JobState"] == "CANCELLED"
    assert slurm_cluster.jobs() == []  # nothing left queued or running
