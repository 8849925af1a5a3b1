"""The drafter trained across two SLURM nodes: two network namespaces on this machine, each a host
with its own address, hosts file and slurmd (``tests.support.slurm_two_nodes``).

The job runs as on a cluster of two machines: one torchrun agent per node, the c10d rendezvous on
the first host of the node list (resolved by name, on the node), gloo between the nodes' own
addresses. It must reach the weights of the same global batch trained by two processes on one
machine, bit for bit; a node lost mid-run fails the run with SLURM's state and the survivor's log,
and the next launch resumes from the last checkpoint. Hidden states extracted data-parallel, a
share per node, land in one manifest equal to one node's; a node lost mid-way loses only its
unfinished shards. Scale: 8 prompts and 16 steps of a tiny
drafter, where a cluster trains for days across 8-GPU nodes; what two hosts add (addresses, name
resolution, the rendezvous port, environment reaching both, a node dying) is the same.
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
import torch

from tests.conftest import _skip_or_fail
from tests.integration.slurm.test_slurm import (
    DATASET,
    RECIPE,
    _checkpoint,
    _failures,
    _materialize,
    after_first_checkpoint,
    assert_equals_two_local_processes,
    corpus_root,
)
from tests.support.dagster_helpers import checks_by_name

pytestmark = [pytest.mark.slurm, pytest.mark.model]

TRAIN_ON_TWO_NODES = {"launcher": "slurm", "threads": 1, "nproc_per_node": 1, "slurm": {"nodes": 2, "tasks_per_node": 1}}


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    from tests.support.slurm_cluster import SlurmClusterError
    from tests.support.slurm_two_nodes import start_two_nodes, stop_two_nodes

    try:
        cluster = start_two_nodes(tmp_path_factory.mktemp("slurm2"))
    except SlurmClusterError as exc:
        _skip_or_fail(f"two SLURM nodes cannot start here: {exc}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", str(cluster.conf))
        try:
            yield cluster
        finally:
            stop_two_nodes(cluster)


@pytest.fixture(scope="module")
def root(two_nodes, model_dir, tmp_path_factory):
    """The one-node tests' data root (one dataset's corpus), its hidden states extracted in this process."""
    with corpus_root(tmp_path_factory, "slurm2-data") as (layout, instance):
        result = _materialize(instance, "hidden_states", DATASET, {"launcher": "local"})
        assert result.success, _failures(result)
        yield layout, instance


@pytest.fixture(scope="module")
def trained(root, two_nodes):
    layout, instance = root
    result = _materialize(instance, "drafter_checkpoint", RECIPE, TRAIN_ON_TWO_NODES)
    assert result.success, _failures(result)
    saved = layout.root / "drafter-two-nodes"
    shutil.copytree(layout.drafter_dir(RECIPE), saved)
    return result, saved


def test_training_across_two_nodes_equals_two_processes_on_one(root, trained, two_nodes, tmp_path):
    result, saved = trained
    meta = {k: v.value for k, v in result.asset_materializations_for_node("drafter_checkpoint")[0].metadata.items()}
    assert meta["slurm_state"] == "COMPLETED" and meta["slurm_tasks"] == 2 and meta["world_size"] == 2
    log = next((saved.parent / "slurm").glob(f"drafter_checkpoint/{RECIPE}/*/slurm-{meta['slurm_job_id']}.out")).read_text()
    a, b = two_nodes.nodes
    assert "2 node(s)" in log and f"head {a}:" in log  # the rendezvous on the first host of the node list
    assert f"rank 0/2 on {a}" in log and f"rank 1/2 on {b}" in log  # each node's output reached the job's log

    assert_equals_two_local_processes(saved, tmp_path)  # two nodes, one rank each, as two processes on one


def test_losing_a_node_fails_the_run_and_the_relaunch_resumes(root, trained, two_nodes):
    layout, instance = root
    _, saved = trained
    out = layout.drafter_dir(RECIPE)
    shutil.rmtree(out)
    watcher, killed = after_first_checkpoint(out, lambda job: two_nodes.kill_node(1))
    first = _materialize(instance, "drafter_checkpoint", RECIPE, TRAIN_ON_TWO_NODES)
    failed_at = time.monotonic()
    watcher.join(60)
    assert killed, "the job ended before a node could be lost"
    assert not first.success
    [message] = _failures(first)
    assert f"SLURM job {killed['job']}" in message and "state " in message and "COMPLETED" not in message, message
    assert "Last lines of" in message and f"on {two_nodes.nodes[0]}" in message  # the survivor's log tail
    print(f"node lost -> run failed in {failed_at - killed['at']:.1f} s; {message.splitlines()[0]}")
    kept = _checkpoint(out)
    assert 2 <= kept["step"] < 16

    two_nodes.restart_node(1)
    second = _materialize(instance, "drafter_checkpoint", RECIPE, TRAIN_ON_TWO_NODES)
    assert second.success, _failures(second)
    final, uninterrupted = _checkpoint(out), _checkpoint(saved)
    assert final["step"] == 16 and final["metrics"][: kept["step"]] == kept["metrics"]
    for name_, t in final["model"].items():
        assert torch.equal(t, uninterrupted["model"][name_]), name_


EXTRACT_ON_TWO_NODES = {"launcher": "slurm", "batch_tokens": 1, "shard_bytes": 1, "slurm": {"nodes": 2, "tasks_per_node": 1}}


def _one_node_reference(layout, model_dir, out):
    """The same corpus extracted by one process here: one sample a forward (as the job's nodes run
    them: ``batch_tokens`` 1) and one thread (the jobs' ``OMP_NUM_THREADS``), so bit equality holds."""
    from eagle3_assets.engines.local.extractor import LocalExtractor
    from eagle3_assets.hidden_states.extract import extract_corpus

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        extract_corpus(layout.corpus(DATASET), out, LocalExtractor(model_dir), batch_tokens=1, shard_bytes=1)
    finally:
        torch.set_num_threads(threads)


def _stored_in_files(directory) -> list[str]:
    """Sample ids in the shard files under ``directory`` (their own metadata, not any journal)."""
    from safetensors import safe_open

    ids = []
    for f in sorted(directory.rglob("shard-*.safetensors")):
        with safe_open(str(f), "pt") as h:
            ids += json.loads(h.metadata()["sample_ids"])
    return ids


def test_extraction_across_two_nodes_equals_one_node(root, two_nodes, model_dir, tmp_path):
    from eagle3_assets.hidden_states.reader import ShardReader

    layout, instance = root
    _one_node_reference(layout, model_dir, tmp_path / "one")
    out = layout.hidden_states_dir(DATASET)
    shutil.rmtree(out)
    result = _materialize(instance, "hidden_states", DATASET, EXTRACT_ON_TWO_NODES)
    assert result.success, _failures(result)
    meta = {k: v.value for k, v in result.asset_materializations_for_node("hidden_states")[0].metadata.items()}
    assert meta["slurm_tasks"] == 2 and meta["extracted_now"] == 8 and checks_by_name(result)["shard_integrity"].passed
    log = next((layout.root / "slurm").glob(f"hidden_states/{DATASET}/*/slurm-{meta['slurm_job_id']}.out")).read_text()
    a, b = two_nodes.nodes
    assert f"extraction node 0/2 on {a}" in log and f"extraction node 1/2 on {b}" in log
    assert not (out / "parts").exists()  # folded into the one manifest
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["corpus"]["rows"] == manifest["num_samples"] == meta["samples_planned"] == 8
    both, one = ShardReader(out), ShardReader(tmp_path / "one")
    assert sorted(both.sample_ids()) == sorted(one.sample_ids()) and len(one.sample_ids()) == 8
    assert sorted(_stored_in_files(out)) == sorted(one.sample_ids())  # each sample stored once
    for sid in one.sample_ids():
        x, y = both.read(sid), one.read(sid)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        assert torch.equal(x.aux_hidden, y.aux_hidden) and torch.equal(x.last_hidden, y.last_hidden), sid


def test_a_lost_node_loses_only_its_unfinished_shards(root, two_nodes):
    """A corpus of 64 samples (the 8 rows eight times over, under new ids: long enough that the
    second node is killed with most of its share still to do)."""
    import polars as pl

    from eagle3_assets.hidden_states.parts import part_dir

    layout, instance = root
    big = f"{DATASET}_big"
    corpus = pl.read_parquet(layout.corpus(DATASET))
    copies = [corpus.with_columns(pl.col("sample_id") + f"-{k}") for k in range(8)]
    layout.corpus(big).parent.mkdir(parents=True, exist_ok=True)
    pl.concat(copies).write_parquet(layout.corpus(big))
    instance.add_dynamic_partitions("datasets", [big])
    n = corpus.height * 8
    out = layout.hidden_states_dir(big)
    second = part_dir(out, 1, 2)
    killed = {}

    def kill_second_node_after_its_first_shard():
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and not list(second.glob("shard-*.safetensors")):
            time.sleep(0.02)
        killed["at"] = time.monotonic()
        two_nodes.kill_node(1)

    watcher = threading.Thread(target=kill_second_node_after_its_first_shard, daemon=True)
    watcher.start()
    first = _materialize(instance, "hidden_states", big, EXTRACT_ON_TWO_NODES)
    watcher.join(60)
    assert killed and not first.success
    [message] = _failures(first)
    assert "Last lines of" in message and "COMPLETED" not in message, message
    kept = _stored_in_files(out)  # what the files on disk hold after the failure
    assert 1 <= len(kept) < n and len(set(kept)) == len(kept)

    two_nodes.restart_node(1)
    again = _materialize(instance, "hidden_states", big, EXTRACT_ON_TWO_NODES)
    assert again.success, _failures(again)
    meta = {k: v.value for k, v in again.asset_materializations_for_node("hidden_states")[0].metadata.items()}
    assert meta["extracted_now"] == n - len(kept)  # only what no shard held was extracted again
    assert meta["samples_planned"] == n and meta["already_done"] == len(kept)
    stored = _stored_in_files(out)
    assert sorted(stored) == sorted(set(stored)) and len(stored) == n
    print(f"node lost mid-extraction: {len(kept)} of {n} samples kept in shards, {n - len(kept)} extracted again")


def test_sglang_extraction_runs_a_tp_group_on_each_node(root, two_nodes, model_dir, tmp_path, monkeypatch):
    """backend sglang on two nodes: a 2-rank tensor-parallel group on each node (SGLang's capture
    replaced by the transformers stand-in, as in test_slurm), each group its share; one manifest,
    states equal to one node's."""
    from eagle3_assets.hidden_states.reader import ShardReader

    layout, instance = root
    monkeypatch.setenv("EAGLE3_SGLANG_CAPTURE", "tests.support.capture:local_capture")  # forwarded to the job
    dataset = f"{DATASET}_sgl"
    instance.add_dynamic_partitions("datasets", [dataset])
    shutil.copy(layout.corpus(DATASET), layout.corpus(dataset))
    _one_node_reference(layout, model_dir, tmp_path / "one")
    result = _materialize(instance, "hidden_states", dataset, {"launcher": "slurm", "backend": "sglang", "tp_size": 2,
                                                               "batch_tokens": 1, "shard_bytes": 1, "slurm": {"nodes": 2}})
    assert result.success, _failures(result)
    meta = {k: v.value for k, v in result.asset_materializations_for_node("hidden_states")[0].metadata.items()}
    assert (meta["slurm_tasks"], meta["extracted_now"], meta["samples_planned"]) == (2, 8, 8)
    out = layout.hidden_states_dir(dataset)
    log = next((layout.root / "slurm").glob(f"hidden_states/{dataset}/*/slurm-{meta['slurm_job_id']}.out")).read_text()
    a, b = two_nodes.nodes
    assert f"extraction node 0/2 on {a}" in log and f"extraction node 1/2 on {b}" in log
    for node in range(2):  # within each node both TP ranks ran every forward of that node's share
        ranks = [(out.parent / f"{dataset}.node{node}.rank{r}.jsonl").read_text() for r in range(2)]
        assert ranks[0] == ranks[1] and ranks[0]
    both, one = ShardReader(out), ShardReader(tmp_path / "one")
    assert sorted(both.sample_ids()) == sorted(one.sample_ids()) and sorted(_stored_in_files(out)) == sorted(one.sample_ids())
    for sid in one.sample_ids():
        assert torch.equal(both.read(sid).aux_hidden, one.read(sid).aux_hidden), sid
        assert torch.equal(both.read(sid).last_hidden, one.read(sid).last_hidden), sid
