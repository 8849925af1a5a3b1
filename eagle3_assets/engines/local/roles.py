"""The roles the ``local`` engine serves: generation by the step's own model, extraction by transformers."""

from __future__ import annotations


class LocalGenerate:
    """The target model in the step itself (``generation.local``): its own ids, on this machine's GPU."""

    in_process = True
    exact_ids = True
    gpu = True
    resources = ()

    def http(self, resources, spec, tokenizer, concurrency: int):
        return None  # nothing to reach over HTTP: the stage runs the model it loads


class LocalExtract:
    """Transformers, in the step (the local launcher) or in the extraction job on each node."""

    in_step = True
    tensor_parallel = False
    resources = ()  # the target, which the stage has

    def step_extractor(self, spec, *, layer_ids, resources):
        from eagle3_assets.engines.local.extractor import LocalExtractor
        from eagle3_assets.target.precision import resolve_device

        target = resources.target
        device = resolve_device(target.device)
        return LocalExtractor(spec.model_dir, layer_ids=layer_ids, device=device, dtype=target.torch_dtype(device),
                              target=spec.identity)

    def job_settings(self, config, target, resources, corpus, spec) -> dict:
        return {}

    def job_extractor(self, job, stack):
        from eagle3_assets.engines.local.extractor import LocalExtractor

        target = job.target.open()
        return LocalExtractor(target.model_dir, layer_ids=job.layer_ids, device=job.device, dtype=job.model_dtype,
                              target=target.identity)


GENERATE = LocalGenerate()
EXTRACT = LocalExtract()
