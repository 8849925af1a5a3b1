"""The roles an engine serves, each a small ``Protocol``, and the data they hand the stages.

An engine (``eagle3_assets/engines/<name>/``) implements the roles it serves and registers one
line per role in ``ROLES`` (``eagle3_assets/engines/__init__.py``); a stage asks the registry for
the role of the engine its config names and never names an engine itself:

- ``Generate`` (the ``raw_responses`` stage): the target's replies, with the engine's own token ids
  where it returns them (``exact_ids``);
- ``Extract`` (the ``hidden_states`` stage): EAGLE-3 features, as an ``Extractor`` in the step or
  in a launched job;
- ``Serve`` (measuring a drafter): a server speculating with a drafter's export, and the acceptance
  its own counters report (``EngineAcceptance``).

What a role returns lives here (``Features``, ``EngineAcceptance``, ``HttpGeneration``), so an
engine imports nothing of the stages and the stages import it from here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

from eagle3_assets.target.layers import N_AUX

# ---- extract ------------------------------------------------------------------------------------

@dataclass
class Features:
    aux: object  # torch.Tensor [T, n_aux * H]
    last: object  # torch.Tensor [T, H]


def check_rows(rows: Sequence[Sequence[int]], *, vocab_size: int | None = None, max_len: int | None = None) -> None:
    """Reject what a prefill cannot take, naming the row: empty, too long, ids out of vocab."""
    for i, row in enumerate(rows):
        if len(row) == 0:
            raise ValueError(f"row {i} is empty: a prefill needs at least one token")
        if max_len is not None and len(row) > max_len:
            raise ValueError(f"row {i} has {len(row)} tokens, over the target's limit of {max_len}")
        if vocab_size is not None:
            lo, hi = min(row), max(row)
            if lo < 0 or hi >= vocab_size:
                raise ValueError(f"row {i} holds token ids in [{lo}, {hi}], outside the vocab 0..{vocab_size - 1}")


def split_packed(packed, lengths: Sequence[int]) -> list:
    """Split a tensor packed along the token axis into per-row tensors, checking the total."""
    if any(n <= 0 for n in lengths):
        raise ValueError(f"every row length must be positive, got {list(lengths)}")
    total = sum(lengths)
    if packed.shape[0] != total:
        raise ValueError(f"packed states hold {packed.shape[0]} tokens but the rows add up to {total}")
    return list(packed.split(list(lengths), dim=0))


def check_features(feats: Sequence[Features], lengths: Sequence[int], hidden_size: int, n_aux: int = N_AUX) -> None:
    """Per row: aux [T, n_aux*H] and last [T, H] with T the row's length."""
    if len(feats) != len(lengths):
        raise ValueError(f"{len(feats)} results for {len(lengths)} rows")
    for i, (f, n) in enumerate(zip(feats, lengths)):
        if tuple(f.aux.shape) != (n, n_aux * hidden_size):
            raise ValueError(f"row {i}: aux states {tuple(f.aux.shape)}, expected ({n}, {n_aux * hidden_size})")
        if tuple(f.last.shape) != (n, hidden_size):
            raise ValueError(f"row {i}: final states {tuple(f.last.shape)}, expected ({n}, {hidden_size})")


def features_from_packed(aux_packed, last_packed, lengths: Sequence[int], hidden_size: int,
                         n_aux: int = N_AUX) -> list[Features]:
    feats = [Features(a, b) for a, b in zip(split_packed(aux_packed, lengths), split_packed(last_packed, lengths))]
    check_features(feats, lengths, hidden_size, n_aux)
    return feats


@runtime_checkable
class Extractor(Protocol):
    """Exact token ids in, one ``Features`` per row out, and what the manifest records."""

    def extract(self, rows: Sequence[Sequence[int]]) -> list[Features]: ...

    def describe(self) -> dict: ...


@runtime_checkable
class Extract(Protocol):
    """The ``hidden_states`` stage's role.

    ``in_step``: with a launcher that runs here, the asset extracts in its own step through
    ``step_extractor``; otherwise (or on another launcher) the stage launches a job. A
    ``tensor_parallel`` engine runs that job as a torchrun group of ``tp_size`` ranks, each holding a
    slice of the model (``TensorParallelExtract``: the stage's tensor-parallel job asks it for each
    rank's capture); the others run the extraction job,
    one process per node, building their extractor there with ``job_extractor`` and the settings
    ``job_settings`` put in the job file."""

    in_step: bool
    tensor_parallel: bool
    resources: tuple[str, ...]  # the Dagster resources it reads (the stage requires them and hands them over)

    def step_extractor(self, spec, *, layer_ids: list[int] | None, resources: Any) -> Extractor: ...

    def job_settings(self, config, target, resources: Any, corpus, spec) -> dict: ...

    def job_extractor(self, job, stack: ExitStack) -> Extractor: ...


@runtime_checkable
class TensorParallelExtract(Extract, Protocol):
    """An extract role whose model is split over a torchrun group (``tensor_parallel``): the stage's
    tensor-parallel job (``hidden_states/sglang_extract.py``) asks it for each rank's capture, sized
    for the corpus's longest row, and for the label its manifest records."""

    def capture(self, job, group, layer_ids: list[int], *, longest_row: int): ...

    def label(self) -> str: ...


# ---- generate -----------------------------------------------------------------------------------

@dataclass
class HttpGeneration:
    """An engine reached over HTTP, as the generation stage's HTTP engine drives it."""

    backend: Any  # keeps the HTTP engine's backend protocol (prepare/request/parse/preflight/postflight/redact)
    client: Any  # engines.http.client.ClientConfig: connections and timeouts
    in_flight: int  # the run's gate: requests in flight for every dataset together


@runtime_checkable
class Generate(Protocol):
    """The ``raw_responses`` stage's role.

    ``in_process``: the target model runs in the step itself (``generation.local``); otherwise
    ``http`` gives the backend the HTTP engine sends through. ``exact_ids``: the replies carry the
    engine's own token ids (not text to re-tokenize). ``gpu``: it runs on this deployment's GPUs,
    so the step holds the ``gpu`` pool while it generates. ``tokenizer`` is called only by an
    engine that renders prompts itself."""

    in_process: bool
    exact_ids: bool
    gpu: bool
    resources: tuple[str, ...]  # the Dagster resources it reads (the stage requires them and hands them over)

    def http(self, resources: Any, spec, tokenizer: Callable[[], Any], concurrency: int) -> HttpGeneration | None: ...


# ---- serve a drafter ----------------------------------------------------------------------------

@dataclass
class EngineAcceptance:
    """What an engine's own counters say about one batch of prompts (the serve role's report)."""

    k: int
    prompts: int
    drafts: int  # verification steps that had drafts
    draft_tokens: int
    accepted_tokens: int
    acceptance_length: float  # 1 + accepted / drafts (SGLang's convention)
    acceptance_length_no_bonus: float
    per_position_rate: list[float]  # accepted at position j / drafts
    output_tokens: int
    matches_greedy: bool | None = None
    outputs: list[list[int]] = field(default_factory=list)

    def as_metadata(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "outputs"}



def compare(project: dict, engine: EngineAcceptance, name: str) -> dict:
    """The project's evaluator (``eval.json['trained']`` or an ``AcceptanceReport.as_metadata()``)
    next to an engine's counters (``name``: vllm or sglang, the keys' prefix)."""
    a, b = float(project["acceptance_length"]), engine.acceptance_length
    return {"project_acceptance_length": round(a, 4), f"{name}_acceptance_length": round(b, 4),
            "difference": round(b - a, 4), "project_per_position": [round(x, 4) for x in project.get("per_position_rate", [])],
            f"{name}_per_position": [round(x, 4) for x in engine.per_position_rate],
            "project_matches_greedy": project.get("matches_greedy"), f"{name}_matches_greedy": engine.matches_greedy,
            f"{name}_verify_steps": engine.drafts, "project_verify_steps": project.get("verify_steps"),
            "project_near_ties": project.get("near_ties")}  # where the two may part on rounding alone


@runtime_checkable
class Serve(Protocol):
    """Serve the target with a drafter's export for this engine (``drafters/<recipe>/<engine>/``), or
    alone, and report the acceptance its own counters give. ``server`` is a context manager (started on enter,
    stopped on exit) whose ``url`` the ``acceptance`` call takes."""

    def server(self, model_dir, drafter_dir, *, k: int, python: str = ""): ...

    def url(self, server) -> str: ...

    def acceptance(self, url: str, prompts: Sequence[Sequence[int]], *, k: int, max_new_tokens: int,
                   greedy_reference: Sequence[Sequence[int]] | None = None,
                   stop_token_ids: Sequence[int] = ()) -> EngineAcceptance: ...

    # the serving benchmark (eagle3_assets/serving/): ``server`` with ``drafter_dir`` None serves the target alone
    takes_trees: bool  # drafts trees (top-k > 1) as well as chains

    def missing(self, python: str = "") -> str | None: ...  # why the engine is not on this machine

    def version(self, python: str = "") -> str: ...

    def problem(self, model_dir, drafter_dir, python: str = "") -> str | None: ...  # why it cannot serve this layout

    def timed(self, client, url: str, ids: Sequence[int], *, max_new_tokens: int,
              stop_token_ids: Sequence[int] = (), model: str = ""): ...  # a streamed request, engines.stream.Streamed

    def counters(self, client, url: str) -> dict: ...  # the server's counters now (before and after a batch)

    def batch_acceptance(self, before: dict, after: dict, replies, steps: int) -> dict: ...

    def user_command(self, model_dir, drafter_dir, *, k: int, topk: int = 1, draft_tokens: int = 0) -> str: ...

    # a drafter export's aux layer ids in this engine's numbering (the project's: id k = output of layer k)
    layer_ids_key: str  # where the hidden-state manifest records them

    def layer_ids(self, ids: Sequence[int]) -> list[int]: ...  # the project's ids as this engine numbers them

    def trained_ids(self, ids: Sequence[int]) -> list[int]: ...  # this engine's ids back in the project's numbering

    def layer_ids_problem(self, ids: Sequence[int]) -> str | None: ...  # why it would serve them on other layers
