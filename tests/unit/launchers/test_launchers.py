"""The launcher interface: each GPU stage builds one ``Launch`` and hands it to the configured
launcher once. A launcher registered in ``LAUNCHERS`` (here a stand-in for a cluster, running the
launch on this machine) reaches both stages; the local launcher's commands are the ones the
stages ran before the interface."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import dagster as dg
import pytest
import torch

from eagle3_assets.launchers import LAUNCHERS, Launch, LocalLauncher, forwarded_env, local_command, open_launcher
from tests.conftest import small_prompts, write_jsonl
from tests.support.dagster_helpers import checks_by_name, run_dataset, run_hidden_states

SEEN: list[tuple[Launch, int]] = []  # what the stand-in cluster launcher was given, and its task count


class ElsewhereLauncher:
    """A stand-in cluster: not ``here`` (so a stage never works in its step), one task on one
    node; it records the launch and runs it as the local launcher would."""

    tasks = nodes = 1
    here = False

    @classmethod
    def open(cls, context, config, layout):
        return cls()

    def running(self, name: str) -> bool:
        return False

    def run(self, context, launch: Launch):
        SEEN.append((launch, self.tasks))
        return LocalLauncher().run(context, launch)


def test_the_local_launcher_runs_the_plain_process_or_a_standalone_torchrun():
    plain = Launch("x", "eagle3_assets.drafter.training", ["--config", "j.json"])
    assert local_command(plain) == [sys.executable, "-m", "eagle3_assets.drafter.training", "--config", "j.json"]
    trainer = Launch("x", "eagle3_assets.drafter.training", ["--config", "j.json"], procs=1, plain_when_alone=True)
    assert local_command(trainer) == local_command(plain)  # one trainer here: no rendezvous, as before
    group = Launch("x", "eagle3_assets.hidden_states.sglang_extract", ["--config", "j.json"], procs=1)
    assert local_command(group) == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                                    "-m", "eagle3_assets.hidden_states.sglang_extract", "--config", "j.json"]
    two = Launch("x", "eagle3_assets.drafter.training", ["--config", "j.json"], procs=2, plain_when_alone=True)
    assert local_command(two)[3:5] == ["--standalone", "--nproc-per-node=2"]
    assert LocalLauncher.open(None, None, None).here and not LocalLauncher().running("x")


def test_an_unknown_launcher_is_refused_naming_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown launcher 'k8s'; expected one of \['local', 'slurm'\]"):
        open_launcher("k8s", None, None, None)


def test_the_training_launch_names_the_trainer_its_workers_and_environment(tmp_path, monkeypatch):
    from eagle3_assets.drafter.assets import DrafterTrainingConfig, launch_training

    monkeypatch.setenv("EAGLE3_HOME", str(tmp_path))
    given = []
    recorder = SimpleNamespace(run=lambda context, launch: given.append(launch) or "invocation")
    context = SimpleNamespace(log=SimpleNamespace(info=lambda msg: None))
    config = DrafterTrainingConfig(nproc_per_node=4)
    assert launch_training(context, config, recorder, "demo", tmp_path / "job.json", 10.0) == "invocation"
    (launch,) = given
    assert (launch.name, launch.module, launch.args) == ("eagle3-drafter_checkpoint-demo", "eagle3_assets.drafter.training",
                                                         ["--config", str(tmp_path / "job.json")])
    assert (launch.procs, launch.per_node, launch.plain_when_alone) == (4, False, True)
    assert launch.exports == forwarded_env() and launch.exports["EAGLE3_HOME"] == str(tmp_path)


@pytest.mark.model
def test_a_registered_launcher_runs_the_extraction_job_the_step_would_have_run_here(layout, model_dir, monkeypatch):
    """``launcher: slurm`` pointed at the stand-in by its one registry line: the stage writes the
    extraction job and launches ``extract_job`` (not the in-step extraction), and the shards equal
    the in-step extraction's bit for bit."""
    from eagle3_assets.hidden_states.reader import ShardReader

    monkeypatch.setitem(LAUNCHERS, "slurm", "tests.unit.launchers.test_launchers:ElsewhereLauncher.open")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # forwarded to the job; the step below runs with one thread too
    SEEN.clear()
    write_jsonl(layout.prompt_source("elsewhere"), small_prompts(3))
    with dg.instance_for_test() as instance:
        assert run_dataset(instance, "elsewhere").success
        result = run_hidden_states(instance, "elsewhere", config={"launcher": "slurm", "shard_bytes": 200_000})
        assert result.success, [e.message for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
        assert checks_by_name(result)["shard_integrity"].passed
        meta = result.asset_materializations_for_node("hidden_states")[0].metadata
        assert (meta["extracted_now"].value, meta["samples_planned"].value) == (3, 3)
        ((launch, tasks),) = SEEN
        assert (launch.name, launch.module, launch.procs, launch.per_node, tasks) == (
            "eagle3-hidden_states-elsewhere", "eagle3_assets.hidden_states.extract_job", None, False, 1)
        job = json.loads((layout.hidden_states_dir("elsewhere").parent / ".elsewhere.extract-job.json").read_text())
        assert launch.args == ["--config", str(layout.hidden_states_dir("elsewhere").parent / ".elsewhere.extract-job.json")]
        assert (job["backend"], job["nodes"], job["corpus"]) == ("local", 1, str(layout.corpus("elsewhere")))

        launched = ShardReader(layout.hidden_states_dir("elsewhere"))
        ids = sorted(launched.sample_ids())
        saved = {sid: launched.read(sid) for sid in ids}
        monkeypatch.setitem(LAUNCHERS, "slurm", LAUNCHERS["local"])
        import shutil

        shutil.rmtree(layout.hidden_states_dir("elsewhere"))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            here = run_hidden_states(instance, "elsewhere", config={"launcher": "local", "shard_bytes": 200_000})
        finally:
            torch.set_num_threads(threads)
        assert here.success and len(SEEN) == 1  # in the step: nothing launched
    in_step = ShardReader(layout.hidden_states_dir("elsewhere"))
    assert sorted(in_step.sample_ids()) == ids and len(ids) == 3
    for sid in ids:
        a, b = saved[sid], in_step.read(sid)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.aux_hidden, b.aux_hidden), sid
        assert torch.equal(a.last_hidden, b.last_hidden), sid


def test_the_architecture_page_names_the_files_and_parts_of_a_new_launcher():
    """docs/architecture.md's step for a new launcher names files that exist, every member of the
    ``Launcher`` protocol and the registry; each registered launcher keeps the protocol."""
    import re

    from eagle3_assets.launchers import Launcher, get_factory
    from eagle3_assets.paths import REPO_ROOT

    text = (REPO_ROOT / "docs" / "architecture.md").read_text()
    step = text[text.index("- **A new launcher**"):]
    step = step[:step.index("\n- **", 1)]
    paths = set(re.findall(r"`((?:eagle3_assets/|slurm/|drafter/|hidden_states/|resources/|tests/)[\w/.]*)`", step))
    assert {"eagle3_assets/launchers.py", "slurm/launcher.py", "hidden_states/launch.py", "drafter/assets.py"} <= paths
    for path in paths:
        assert any((REPO_ROOT / base / path).exists() for base in ("", "eagle3_assets")), path
    members = {n for n in Launcher.__annotations__} | {n for n in vars(Launcher) if not n.startswith("_")}
    assert members == {"tasks", "nodes", "here", "running", "run", "start"}
    for name in members:
        assert f"`{name}" in step, name
    assert "`LAUNCHERS`" in step and "`Launch`" in step
    for name in LAUNCHERS:  # the registered factories resolve, and their classes keep the protocol
        cls = get_factory(name).__self__
        assert all(hasattr(cls, m) for m in members - {"tasks", "nodes"}), name  # these two: per launch


# The sleeper reports its signal masks, so a SIGTERM it could not act on names the reason.
SLEEPER = ("import time; print('up', *[l for l in open('/proc/self/status') if l.startswith(('SigBlk', 'SigIgn'))],"
           " flush=True); time.sleep(120)")


def start_sleeper(tmp_path):
    """A process started by the local launcher, returned once it is up."""
    import time

    (tmp_path / "sleeper.py").write_text(SLEEPER)
    context = SimpleNamespace(log=SimpleNamespace(info=lambda msg: None))
    started = LocalLauncher().start(context, Launch("beside", "sleeper", [], exports={"PYTHONPATH": str(tmp_path)}),
                                    tmp_path / "b")
    assert started.log == tmp_path / "b" / "output.log"
    t0 = time.monotonic()
    while "up" not in started.log.read_text() and time.monotonic() - t0 < 60:
        assert started.poll() is None
        time.sleep(0.05)
    assert started.poll() is None  # still running after start returned
    return started


def test_the_local_launcher_starts_a_process_beside_the_step_and_stops_it(tmp_path):
    """``start`` returns while the process runs (the streaming producers run beside the trainer's
    ``run``); its output lands in the folder; ``stop`` ends it with SIGTERM."""
    import time

    context = SimpleNamespace(log=SimpleNamespace(info=lambda msg: None))
    launch = Launch("beside", "eagle3_no_such_module", [])
    failed = LocalLauncher().start(context, launch, tmp_path / "a")
    t0 = time.monotonic()
    while failed.poll() is None and time.monotonic() - t0 < 60:
        time.sleep(0.05)
    assert failed.poll() == 1 and "No module named eagle3_no_such_module" in failed.log.read_text()

    started = start_sleeper(tmp_path)
    t0 = time.monotonic()
    started.stop(grace_s=30)  # SIGTERM, then SIGKILL after the grace: the default disposition needs none
    assert started.poll() == -15, (f"ended by {started.poll()} after {time.monotonic() - t0:.1f} s; "
                                   f"its output: {started.log.read_text()!r}")


def test_a_started_process_still_stops_on_sigterm_where_dagster_left_sigterm_ignored(tmp_path):
    """Started with SIGINT ignored (``nohup``, ``cmd &``, a CI runner), a process that ran Dagster in
    process is left ignoring SIGTERM (Dagster maps it to SIGINT's disposition), and an ignored
    signal survives ``exec``: without the launcher's reset its children ignore ``stop`` and die
    only by SIGKILL at the end of the grace."""
    import signal

    from dagster._utils.interrupts import capture_interrupts

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with capture_interrupts():  # what a Dagster step executed in this process goes through
            pass
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN, "Dagster no longer leaves SIGTERM ignored"
        started = start_sleeper(tmp_path)
        started.stop(grace_s=30)
        assert started.poll() == -signal.SIGTERM
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_streaming_producers_on_slurm_are_one_node_jobs_of_their_own(tmp_path, monkeypatch):
    """On SLURM each producer is a job of ``stream.slurm``'s shape, one node and one task unless it
    says otherwise (where the trainer's resource asks for two), submitted by ``start`` without
    following it; its script runs the producer's module on one task."""
    from eagle3_assets.drafter.assets import DrafterTrainingConfig, producer_launcher
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.resources import SlurmResource
    from eagle3_assets.slurm import launcher as slurm_launcher

    submitted = []
    monkeypatch.setattr(slurm_launcher.scheduler, "live_jobs_named", lambda name: [])
    monkeypatch.setattr(slurm_launcher.scheduler, "sbatch", lambda script: submitted.append(script) or "42")
    context = SimpleNamespace(resources=SimpleNamespace(slurm=SlurmResource(nodes=2, tasks_per_node=2)),
                              log=SimpleNamespace(info=lambda msg: None), run=SimpleNamespace(run_id="r" * 32))
    config = DrafterTrainingConfig(launcher="slurm", stream={"slurm": {"sbatch_options": ["--exclusive"]}})
    launcher = producer_launcher(context, config, DataLayout(tmp_path / "data"))
    assert (launcher.nodes, launcher.tasks) == (1, 1)
    launch = Launch("eagle3-stream-producer-demo-0", "eagle3_assets.hidden_states.spool", ["--config", "p.json"])
    started = launcher.start(context, launch, tmp_path / "producer-0")
    assert submitted == [tmp_path / "producer-0" / "job.sh"] and started.log == tmp_path / "producer-0" / "slurm-42.out"
    script = submitted[0].read_text()
    assert "#SBATCH --nodes=1" in script and "#SBATCH --exclusive" in script and "#SBATCH --ntasks-per-node=1" in script
    assert "srun --export=ALL --kill-on-bad-exit=1 --nodes=1 --ntasks=1 " in script
    assert "-m eagle3_assets.hidden_states.spool --config p.json" in script
