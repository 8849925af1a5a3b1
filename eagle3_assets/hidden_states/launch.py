"""The ``hidden_states`` asset's extraction as one launch per dataset, on the step's launcher
(``eagle3_assets.launchers``), every backend; the job file is shaped by the tasks and nodes the
launcher gives:

- an engine whose extract role is not ``tensor_parallel`` (``local``, ``vllm``): ``extract_job`` as
  one process on the job's node, or one per node of a several-node job, each its share of the
  corpus (``parts.py``), folded into one manifest after; the role builds the job's extractor (vLLM's
  starts an extraction server on the node) from the settings its ``job_settings`` put in the file;
- a ``tensor_parallel`` one (``sglang``): the SGLang job (``sglang_extract``) under ``torchrun``: on
  one node, ``tp_size`` ranks over the job's tasks (here: one standalone torchrun); on several, a
  ``tp_size`` group on each node with its share of the corpus (``tp_across_nodes: true``: one group
  over them all).

The job writes into the dataset's hidden-state directory (on a cluster, on the shared filesystem),
so a job that was cancelled, preempted or timed out leaves its finished shards, and the next
launch resumes. The local launcher with an ``in_step`` engine (``local``, ``vllm``) extracts in the
step instead (``hidden_states/assets.py``).
"""

from __future__ import annotations

from eagle3_assets.engines import engine_role
from eagle3_assets.hidden_states.extract import ExtractionReport
from eagle3_assets.hidden_states.extract_job import ExtractionJob
from eagle3_assets.hidden_states.parts import combine_reports, merge_parts, report_name
from eagle3_assets.hidden_states.sglang_extract import load_report
from eagle3_assets.launchers import Launch, forwarded_env
from eagle3_assets.target.ref import TargetRef


def extraction_launch(config, target, resources, corpus, out, dataset: str, tasks: int, nodes: int = 1) -> Launch:
    """The job file for ``tasks`` tasks on ``nodes`` nodes, and the launch that runs it; ``resources``:
    the step's, those the engine's extract role reads for the job file (vLLM's: ``vllm``, ``slurm``)."""
    spec = target.spec()
    name = f"eagle3-hidden_states-{dataset}"
    role = engine_role("extract", config.backend)
    if role.tensor_parallel:
        from eagle3_assets.hidden_states.sglang_launch import capture_args, write_sglang_job

        if nodes > 1 and not config.tp_across_nodes:  # a TP group per node, each its share of the corpus
            if tasks != nodes:
                raise ValueError(f"a TP group per node runs one task per node; the job has {tasks} tasks on "
                                 f"{nodes} nodes (set slurm.tasks_per_node: 1, or tp_across_nodes: true)")
            job_path = write_sglang_job(config, spec, corpus, out, nodes=nodes, model_dtype=target.dtype)
            return Launch(name, "eagle3_assets.hidden_states.sglang_extract",
                          ["--config", str(job_path), *capture_args()], procs=config.tp_size, per_node=True,
                          exports=forwarded_env())
        if config.tp_size % tasks:
            raise ValueError(f"tp_size {config.tp_size} does not divide over the job's {tasks} task(s)")
        job_path = write_sglang_job(config, spec, corpus, out, model_dtype=target.dtype)
        return Launch(name, "eagle3_assets.hidden_states.sglang_extract", ["--config", str(job_path), *capture_args()],
                      procs=config.tp_size // tasks, exports=forwarded_env())
    job = ExtractionJob(
        backend=config.backend, target=TargetRef.of(spec), corpus=str(corpus),
        out_dir=str(out), layer_ids=config.layer_ids or None, device=target.device, model_dtype=target.dtype,
        dtype=config.dtype,
        shard_bytes=config.shard_bytes, batch_tokens=config.batch_tokens, retry_quarantined=config.retry_quarantined,
        threads=target.threads, nodes=tasks,
        **role.job_settings(config, target, resources, corpus, spec),
    )
    out.mkdir(parents=True, exist_ok=True)
    job_path = out.parent / f".{out.name}.extract-job.json"
    job_path.write_text(job.model_dump_json(indent=2))
    return Launch(name, "eagle3_assets.hidden_states.extract_job", ["--config", str(job_path)],
                  exports=forwarded_env(), per_node=tasks > 1)


def launch_extraction(context, config, target, resources, launcher, layout, dataset: str) -> tuple[ExtractionReport, dict]:
    """Run the dataset's extraction as one launch; rank 0's report (the nodes' reports combined when
    every node had its share) and the launch's metadata."""
    out = layout.hidden_states_dir(dataset)
    if not layout.corpus(dataset).exists():  # refused here, not after the job's wait in a queue
        raise FileNotFoundError(f"no corpus for dataset {dataset!r} at {layout.corpus(dataset)}: "
                                f"materialize merged_corpus[{dataset}] first")
    tasks = launcher.tasks
    launch = extraction_launch(config, target, resources, layout.corpus(dataset), out, dataset, tasks, launcher.nodes)
    if not launcher.running(launch.name):  # what nodes of an earlier job finished, kept before it starts
        merge_parts(out)
    invocation = launcher.run(context, launch)
    invocation.get_results()
    if not launch.per_node:
        return load_report(out), dict(invocation.metadata)
    manifest = merge_parts(out)
    reports = [load_report_file(out / report_name(r, tasks)) for r in range(tasks)]
    report = combine_reports(reports, ExtractionReport)
    # the nodes planned their shares of what was not stored yet; the job planned the whole corpus
    report.out_dir, report.planned = str(out), manifest["corpus"]["rows"]
    report.already_done = report.planned - report.extracted - report.quarantined_new
    return report, dict(invocation.metadata)


def load_report_file(path) -> ExtractionReport:
    import json

    return ExtractionReport(**json.loads(path.read_text()))
