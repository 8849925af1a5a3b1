"""The roles vLLM serves: generation with exact ids (any OpenAI-compatible server that returns token
ids), extraction through an extraction server, serving a drafter."""

from __future__ import annotations

from eagle3_assets.engines.roles import HttpGeneration


class VLLMGenerate:
    """``/v1/chat/completions`` (or ``/v1/completions`` with the rendered ids) with ``return_token_ids``."""

    in_process = False
    exact_ids = True
    gpu = True
    resources = ("vllm",)

    def http(self, resources, spec, tokenizer, concurrency: int) -> HttpGeneration:
        from eagle3_assets.engines.http.client import client_config
        from eagle3_assets.engines.vllm.openai_ids import openai_ids_backend

        tok = tokenizer()
        r = resources.vllm
        stops = [tok.end_of_turn_id]  # the template's turn end: K2.5's eos_token_id is not it
        backend = openai_ids_backend(r, tok.render_prompt, spec.served_name, stop_token_ids=stops)
        return HttpGeneration(backend, client_config(r), concurrency or r.default_in_flight())


class VLLMExtract:
    """In the step, the extraction servers the ``vllm`` resource names; in a launched job, a server
    the job starts on its node from the settings carried in the job file."""

    in_step = True
    tensor_parallel = False
    resources = ("vllm", "slurm")  # slurm: the vLLM environment on the cluster's nodes

    def step_extractor(self, spec, *, layer_ids, resources):
        from eagle3_assets.engines.vllm.extraction import step_extractor

        return step_extractor(resources.vllm, spec, layer_ids)

    def job_settings(self, config, target, resources, corpus, spec) -> dict:
        from eagle3_assets.engines.vllm.extraction import server_spec

        return {"vllm": server_spec(config, target, resources.vllm, resources.slurm, corpus, spec)}

    def job_extractor(self, job, stack):
        from eagle3_assets.engines.vllm.extraction import job_extractor

        return job_extractor(job, stack)


class VLLMServe:
    """A vLLM server with the drafter's vLLM export as its speculative config (``k`` tokens), or the
    target alone (no ``drafter_dir``); its Prometheus counters, read before and after, are the
    acceptance. vLLM's EAGLE-3 drafts chains only (``takes_trees``)."""

    takes_trees = False

    def server(self, model_dir, drafter_dir, *, k: int, python: str = "", topk: int = 1, draft_tokens: int = 0):
        from eagle3_assets.engines.vllm.server import VLLMServer

        if drafter_dir is None:
            return VLLMServer(model_dir, role="generate", python=python)
        return VLLMServer(model_dir, role="speculate", drafter_dir=drafter_dir, num_speculative_tokens=k, python=python)

    def url(self, server) -> str:
        return server.api_url

    def acceptance(self, url, prompts, *, k, max_new_tokens, greedy_reference=None, stop_token_ids=()):
        from eagle3_assets.engines.vllm.acceptance import measure_acceptance

        return measure_acceptance(url, prompts, k=k, max_new_tokens=max_new_tokens, greedy_reference=greedy_reference,
                                  stop_token_ids=stop_token_ids)

    def missing(self, python: str = "") -> str | None:
        from eagle3_assets.engines.vllm.server import default_python, vllm_available

        return None if vllm_available(python or None) else f"no vLLM environment at {python or default_python()}"

    def version(self, python: str = "") -> str:
        from eagle3_assets.engines.vllm.server import default_python, engine_info

        return " ".join(engine_info(python or default_python()))

    def problem(self, model_dir, drafter_dir, python: str = "") -> str | None:
        from eagle3_assets.engines.vllm.server import default_python, serving_problem

        return serving_problem(python or default_python(), "speculate", model_dir, drafter_dir)

    def timed(self, client, url, ids, *, max_new_tokens, stop_token_ids=(), model: str = ""):
        from eagle3_assets.engines.vllm.serving import timed_completion

        return timed_completion(client, url, model, ids, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)

    def counters(self, client, url) -> dict:
        from eagle3_assets.engines.vllm.serving import counters

        return counters(client, url)

    def batch_acceptance(self, before, after, replies, steps: int) -> dict:
        from eagle3_assets.engines.vllm.serving import batch_acceptance

        return batch_acceptance(before, after, replies, steps)

    def user_command(self, model_dir, drafter_dir, *, k: int, topk: int = 1, draft_tokens: int = 0) -> str:
        from eagle3_assets.engines.vllm.serving import user_command

        return user_command(model_dir, drafter_dir, k)

    layer_ids_key = "speculators_layer_ids"

    def layer_ids(self, ids) -> list[int]:
        from eagle3_assets.target.layers import to_speculators_ids

        return to_speculators_ids(list(ids))  # speculators' numbering: 0 is the embeddings

    def trained_ids(self, ids) -> list[int]:
        return [i - 1 for i in ids]

    def layer_ids_problem(self, ids) -> str | None:
        from eagle3_assets.target.layers import vllm_shift_problem

        return vllm_shift_problem(list(ids))


GENERATE = VLLMGenerate()
EXTRACT = VLLMExtract()
SERVE = VLLMServe()
