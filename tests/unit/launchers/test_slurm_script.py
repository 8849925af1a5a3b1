"""The SLURM launcher's parts that need no scheduler: the batch script (run by bash against stand-ins
for ``srun`` and ``scontrol``), the resource's job shape, parsing what SLURM prints, the readers
of files written on another host. The real scheduler is in ``test_slurm.py``."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

from eagle3_assets.slurm import scheduler
from eagle3_assets.slurm.script import JobEnvironment, JobResources, Launch, forwarded_env, render_script
from eagle3_assets.slurm.shared_files import FileTail, SharedFileMessageReader

SCONTROL_LINE = (
    "JobId=3 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901757 Nice=0 Account=(null) "
    "QOS=(null) JobState=CANCELLED Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 "
    "ExitCode=0:15 RunTime=00:00:01 TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=2026-12-01T21:36:25 "
    "EligibleTime=2026-12-01T21:36:25 AccrueTime=2026-12-01T21:36:25 StartTime=2026-12-01T21:36:26 "
    "EndTime=2026-12-01T21:36:27 Deadline=N/A Partition=debug AllocNode:Sid=localhost:2598 NodeList=gpu[01-02] "
    "BatchHost=gpu01 NumNodes=2 NumCPUs=2 NumTasks=2 CPUs/Task=1 TRES=cpu=2,mem=20000M,node=1,billing=2 "
    "Command=(null) WorkDir=/tmp/with space StdOut=/tmp/a-3.out Power="
)


def _stand_ins(bin_dir: Path) -> None:
    """``scontrol show hostnames``, ``module``, and ``srun`` recording the command each task would run."""
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/bash\necho gpu01\necho gpu02\n')
    (bin_dir / "module").write_text("#!/bin/bash\n")
    (bin_dir / "srun").write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$SRUN_RECORD"\nexit "${SRUN_EXIT:-0}"\n')
    for f in bin_dir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IEXEC)


def _run_script(tmp_path: Path, text: str, exit_code: int = 0) -> tuple[subprocess.CompletedProcess, list[str]]:
    script = tmp_path / "job.sh"
    script.write_text(text)
    _stand_ins(tmp_path / "bin")
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[01-02]",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "2", "SRUN_RECORD": str(tmp_path / "srun.args"),
           "SRUN_EXIT": str(exit_code)}
    res = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    return res, (tmp_path / "srun.args").read_text().splitlines()


def test_torchrun_under_srun_rendezvous_on_the_first_node(tmp_path):
    launch = Launch("eagle3-drafter_checkpoint-demo", "eagle3_assets.drafter.training", ["--config", "/shared/job.json"],
                    procs=8, exports={"DAGSTER_PIPES_CONTEXT": "eJyrVkrOz0nNS0/NSy0GAA==", "EAGLE3_HOME": "/shared/data"})
    resources = JobResources(partition="h200", account="llm", qos="high", nodes=2, gpus_per_node=8, cpus_per_task=64,
                             mem="0", time_limit="24:00:00", sbatch_options=["--exclusive"])
    env = JobEnvironment(modules=["cuda/12.4"], setup=["export NCCL_DEBUG=WARN"], python="/shared/venv/bin/python")
    text = render_script(launch, resources, env, tmp_path, comment="dagster-run:abc")
    for line in ("#SBATCH --job-name=eagle3-drafter_checkpoint-demo", f"#SBATCH --output={tmp_path}/slurm-%j.out",
                 "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=h200", "#SBATCH --account=llm",
                 "#SBATCH --qos=high", "#SBATCH --mem=0", "#SBATCH --time=24:00:00", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --cpus-per-task=64", "#SBATCH --exclusive", "#SBATCH --comment=dagster-run:abc",
                 "#SBATCH --no-requeue",
                 "module load cuda/12.4", "export NCCL_DEBUG=WARN", "export EAGLE3_HOME=/shared/data"):
        assert line in text.splitlines(), line
    # environment setup comes before the exports and the srun line
    assert text.index("module load") < text.index("export EAGLE3_HOME") < text.index("srun ")

    res, argv = _run_script(tmp_path, text)
    assert res.returncode == 0, res.stderr
    assert argv[:3] == ["--export=ALL", "--kill-on-bad-exit=1", "/shared/venv/bin/python"]
    assert argv[3:] == ["-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=gpu01:{20000 + 4242 % 20000}", "--rdzv-id=eagle3-4242",
                        "-m", "eagle3_assets.drafter.training", "--config", "/shared/job.json"]
    record = json.loads((tmp_path / "exit-4242.json").read_text())
    assert record["exit_code"] == 0 and record["nodes"] == "gpu[01-02]"
    assert "2 node(s) [gpu[01-02]], 2 task(s), head gpu01:24242" in res.stdout


def test_plain_process_on_one_node_in_a_container_and_the_exit_code_kept(tmp_path):
    launch = Launch("eagle3-hidden_states-qa", "eagle3_assets.hidden_states.extract_job", ["--config", "/d/x y.json"])
    env = JobEnvironment(container="/shared/eagle3.sif", container_mounts=["/shared"], python="python")
    text = render_script(launch, JobResources(gpus_per_node=8), env, tmp_path)
    res, argv = _run_script(tmp_path, text, exit_code=3)
    assert res.returncode == 3
    assert argv == ["--export=ALL", "--kill-on-bad-exit=1", "--nodes=1", "--ntasks=1", "apptainer", "exec", "--nv",
                    "--bind=/shared", "/shared/eagle3.sif", "python", "-m", "eagle3_assets.hidden_states.extract_job",
                    "--config", "/d/x y.json"]
    assert json.loads((tmp_path / "exit-4242.json").read_text())["exit_code"] == 3

    # data-parallel over nodes: the plain process on every task, each its share
    per_node = Launch(launch.name, launch.module, launch.args, per_node=True)
    line = next(x for x in render_script(per_node, JobResources(nodes=2), JobEnvironment(), tmp_path).splitlines()
                if x.startswith("srun"))
    assert "--nodes=1" not in line and "--ntasks=1" not in line
    # a TP group per node: a standalone torchrun on every task, no rendezvous across nodes
    groups = Launch(launch.name, "eagle3_assets.hidden_states.sglang_extract", ["--config", "j.json"], procs=8, per_node=True)
    line = next(x for x in render_script(groups, JobResources(nodes=2), JobEnvironment(), tmp_path).splitlines()
                if x.startswith("srun"))
    assert "--standalone --nproc-per-node=8" in line and "--rdzv" not in line and "--nodes=1" not in line

    pyxis = JobEnvironment(container="nvcr.io#org/eagle3:0.1", container_runtime="pyxis", container_mounts=["/shared"])
    line = next(x for x in render_script(launch, JobResources(), pyxis, tmp_path).splitlines() if x.startswith("srun"))
    assert shlex.split(line)[5:8] == ["--container-image=nvcr.io#org/eagle3:0.1", "--container-mounts=/shared:/shared",
                                      "python"]


def test_a_failing_setup_line_ends_the_job_before_the_stage(tmp_path):
    env = JobEnvironment(setup=["false"], python="python")
    text = render_script(Launch("x", "m", []), JobResources(), env, tmp_path)
    script = tmp_path / "job.sh"
    script.write_text(text)
    res = subprocess.run(["bash", str(script)], capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    assert res.returncode != 0 and "eagle3: job" not in res.stdout


def test_the_resource_shape_with_per_launch_overrides(tmp_path):
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.resources import SlurmJobConfig, SlurmResource

    r = SlurmResource(partition="h200", nodes=1, gpus_per_node=8, time_limit="12:00:00", sbatch_options=["--exclusive"],
                      venv="/shared/venv")
    shape = r.job_resources(SlurmJobConfig(nodes=2, time_limit="48:00:00", sbatch_options=["--constraint=ib"]))
    assert (shape.nodes, shape.gpus_per_node, shape.time_limit, shape.tasks) == (2, 8, "48:00:00", 2)
    assert shape.sbatch_options == ["--exclusive", "--constraint=ib"]
    layout = DataLayout(tmp_path / "data")
    env = r.job_environment(layout)
    assert env.python == "/shared/venv/bin/python" and str(layout.root) in env.container_mounts
    assert r.root(layout) == layout.root / "slurm"
    assert forwarded_env({"EAGLE3_HOME": "/d", "HF_HUB_OFFLINE": "1", "OPENROUTER_API_KEY": "sk-x", "PATH": "/bin"}) \
        == {"EAGLE3_HOME": "/d", "HF_HUB_OFFLINE": "1"}  # never a secret the job does not need


def test_what_scontrol_and_squeue_print_is_parsed():
    fields = dict(scheduler._PAIR.findall(SCONTROL_LINE))
    assert (fields["JobState"], fields["ExitCode"], fields["NodeList"]) == ("CANCELLED", "0:15", "gpu[01-02]")
    assert fields["WorkDir"] == "/tmp/with space" and fields["Power"] == ""
    assert [scheduler.duration_s(t) for t in ("00:00:03", "5:07", "1-02:03:04", "INVALID")] == [3, 307, 93784, None]
    [entry] = scheduler._entries("17|PENDING|Resources||0:00|2026-12-02T10:00:00|2026-12-01T21:36:25|eagle3-x|dagster-run:r")
    assert entry.live and entry.reason == "Resources" and entry.comment == "dagster-run:r"


@pytest.mark.parametrize("state,words", [("TIMEOUT", "reached its time limit"), ("PREEMPTED", "was preempted"),
                                         ("CANCELLED", "cancelled"), ("OUT_OF_MEMORY", "ran out of memory"),
                                         ("NODE_FAIL", "lost a node")])
def test_every_way_a_job_ends_says_what_happened(state, words):
    record = scheduler.FinalRecord("9", state, "0:15", "gpu01", 12.0, 3.0, "None", "scontrol")
    assert not record.ok
    text = record.describe()
    assert text.startswith(f"SLURM job 9 {words}") and f"state {state}" in text and "reason" not in text


def test_file_tail_returns_whole_lines_and_the_last_state_of_a_redrawn_line(tmp_path):
    path = tmp_path / "out"
    tail = FileTail(path)
    assert tail.read() == []  # not written yet
    path.write_bytes(b"one\ntw")
    assert tail.read() == ["one"]
    with path.open("ab") as fh:
        fh.write(b"o\nbar 10%\rbar 50%\rbar 100%\n")
    assert tail.read() == ["two", "bar 100%"]
    assert tail.tail(2) == "two\nbar 100%"


def test_message_reader_waits_for_a_line_written_in_two_pieces(tmp_path):
    got = []

    class Handler:
        def handle_message(self, message):
            got.append(message)

        def report_pipes_framework_exception(self, origin, exc_info):
            got.append(("error", origin, exc_info))

    path = tmp_path / "messages.jsonl"
    reader = SharedFileMessageReader(str(path), interval=0.02)
    done = threading.Event()
    thread = threading.Thread(target=reader._reader_thread, args=(Handler(), done))
    thread.start()
    line = json.dumps({"__dagster_pipes_version": "0.1", "method": "log", "params": {"message": "hi"}})
    with path.open("w") as fh:
        fh.write(line[:20])
        fh.flush()
        time.sleep(0.2)  # a reader that parsed what it saw would fail on half a line here
        fh.write(line[20:] + "\n")
    time.sleep(0.2)
    done.set()
    thread.join(5)
    assert got == [json.loads(line)]


@pytest.mark.parametrize("name,asset", [("kimi-k2.5-hidden-states", "hidden_states"),
                                        ("kimi-k2.5-drafter", "drafter_checkpoint")])
def test_the_documented_cluster_configs_are_valid_run_config(name, asset, tmp_path):
    import dagster as dg
    import yaml

    from eagle3_assets.definitions import defs
    from eagle3_assets.paths import REPO_ROOT, DataLayout
    from eagle3_assets.resources import SlurmResource

    run_config = yaml.safe_load((REPO_ROOT / "deploy" / "slurm" / f"{name}.yaml").read_text())
    assert dg.validate_run_config(defs.resolve_implicit_global_asset_job_def(), run_config)
    assert run_config["ops"][asset]["config"]["launcher"] == "slurm"
    slurm = SlurmResource(**run_config["resources"]["slurm"]["config"])
    text = render_script(Launch("x", "m", []), slurm.job_resources(), slurm.job_environment(DataLayout(tmp_path)), tmp_path)
    for line in ("#SBATCH --partition=h200", "#SBATCH --gpus-per-node=8", "#SBATCH --exclusive", "module load cuda/12.8",
                 "source /shared/eagle3/.venv/bin/activate"):
        assert line in text.splitlines(), line
