"""The roles SGLang serves: generation with exact ids, tensor-parallel extraction, serving a drafter."""

from __future__ import annotations

from eagle3_assets.engines.roles import HttpGeneration


class SGLangGenerate:
    """``POST /generate`` with locally rendered prompt ids; ``output_ids`` as the server returns them."""

    in_process = False
    exact_ids = True
    gpu = True
    resources = ("sglang",)

    def http(self, resources, spec, tokenizer, concurrency: int) -> HttpGeneration:
        from eagle3_assets.engines.http.client import client_config
        from eagle3_assets.engines.sglang.backend import sglang_backend

        tok = tokenizer()
        r = resources.sglang
        stops = [tok.end_of_turn_id]  # the template's turn end: K2.5's eos_token_id is not it
        backend = sglang_backend(r, tok.render_prompt, stop_token_ids=stops, parse_tool_calls=tok.parse_tool_calls)
        return HttpGeneration(backend, client_config(r), concurrency or r.default_in_flight())


class SGLangExtract:
    """SGLang's ModelRunner in each rank of a torchrun group (``hidden_states/sglang_extract.py``
    runs it), never in the step: its model is split over ``tp_size`` processes."""

    in_step = False
    tensor_parallel = True
    resources = ()

    def step_extractor(self, spec, *, layer_ids, resources):
        raise ValueError("the sglang engine extracts in a launched tensor-parallel job, not in the step")

    def job_settings(self, config, target, resources, corpus, spec) -> dict:
        return {}

    def job_extractor(self, job, stack):
        raise ValueError("the sglang engine extracts in its tensor-parallel job (hidden_states/sglang_extract.py), "
                         "not in the extraction job")

    def capture(self, job, group, layer_ids, *, longest_row: int):
        """This rank's SGLang model (``SGLangCapture``), its KV pool sized for ``longest_row``."""
        import os

        from eagle3_assets.engines.sglang.cpu import enable_in_process

        enable_in_process()  # a CPU machine: SGLang's CPU engine, as a server started by the project gets
        from eagle3_assets.engines.sglang.capture import SGLangCapture
        from eagle3_assets.target.precision import resolve_dtype

        return SGLangCapture(job.target.model_dir, layer_ids=layer_ids, tp_rank=group.rank, tp_size=group.world_size,
                             gpu_id=group.local_rank, batch_tokens=job.batch_tokens, longest_row=longest_row,
                             max_rows=job.max_rows, dtype=resolve_dtype(job.model_dtype),
                             trust_remote_code=job.target.trust_remote_code, server_args=job.server_args,
                             nccl_port=int(os.environ.get("MASTER_PORT") or _free_port()))

    def label(self) -> str:
        """The backend the manifest records: the engine and its one supported release."""
        from eagle3_assets.engines.sglang.versions import SGLANG_VERSION

        return f"sglang-{SGLANG_VERSION}"


def _free_port() -> int:
    """A free local port for the runner's own group when no torchrun gave one (a one-rank capture)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SGLangServe:
    """An SGLang server speculating with the drafter's SGLang export (``k`` steps; a chain, or a tree of
    ``topk`` branches and ``draft_tokens`` nodes), or the target alone (no ``drafter_dir``); its
    per-request counters are the acceptance."""

    takes_trees = True

    def server(self, model_dir, drafter_dir, *, k: int, python: str = "", topk: int = 1, draft_tokens: int = 0):
        from eagle3_assets.engines.sglang.server import SGLangServer

        if drafter_dir is None:  # the same attention backend as the speculating server: one engine, two settings
            return SGLangServer(model_dir, python=python, attention_backend="intel_amx")
        return SGLangServer(model_dir, python=python, drafter_dir=drafter_dir, speculative_steps=k, attention_backend="intel_amx",
                            speculative_topk=topk, speculative_draft_tokens=draft_tokens)

    def url(self, server) -> str:
        return server.base_url

    def acceptance(self, url, prompts, *, k, max_new_tokens, greedy_reference=None, stop_token_ids=()):
        from eagle3_assets.engines.sglang.acceptance import measure_acceptance

        return measure_acceptance(url, prompts, k=k, max_new_tokens=max_new_tokens, greedy_reference=greedy_reference,
                                  stop_token_ids=stop_token_ids)

    def missing(self, python: str = "") -> str | None:
        from eagle3_assets.engines.sglang.server import default_python, sglang_available

        return None if sglang_available(python or None) else f"no SGLang environment at {python or default_python()}"

    def version(self, python: str = "") -> str:
        from eagle3_assets.engines.sglang.server import default_python, installed_version

        return f"sglang {installed_version(python or default_python())}"

    def problem(self, model_dir, drafter_dir, python: str = "") -> str | None:
        from eagle3_assets.engines.sglang.server import default_python, installed_version, serving_problem
        from eagle3_assets.engines.sglang.versions import require_supported_sglang
        from eagle3_assets.engines.versions import EngineVersionError

        version = installed_version(python or default_python())
        try:
            require_supported_sglang(version, python or default_python())
        except EngineVersionError as e:
            return str(e)
        return serving_problem(version, model_dir, drafter_dir)

    def timed(self, client, url, ids, *, max_new_tokens, stop_token_ids=(), model: str = ""):
        from eagle3_assets.engines.sglang.serving import timed_generate

        return timed_generate(client, url, ids, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)

    def counters(self, client, url) -> dict:
        return {}  # per request, in each reply

    def batch_acceptance(self, before, after, replies, steps: int) -> dict:
        from eagle3_assets.engines.sglang.serving import batch_acceptance

        return batch_acceptance(replies, steps)

    def user_command(self, model_dir, drafter_dir, *, k: int, topk: int = 1, draft_tokens: int = 0) -> str:
        from eagle3_assets.engines.sglang.serving import user_command

        return user_command(model_dir, drafter_dir, k, topk, draft_tokens)

    layer_ids_key = "sglang_layer_ids"

    def layer_ids(self, ids) -> list[int]:
        return list(ids)  # SGLang's numbering is the project's

    def trained_ids(self, ids) -> list[int]:
        return list(ids)

    def layer_ids_problem(self, ids) -> str | None:
        from eagle3_assets.target.layers import sglang_shift_problem

        return sglang_shift_problem(list(ids))


GENERATE = SGLangGenerate()
EXTRACT = SGLangExtract()
SERVE = SGLangServe()
