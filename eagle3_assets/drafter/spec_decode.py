"""Acceptance length by real chain speculative decoding against the Hugging Face target.

One round (batch of one sequence, greedy):

1. the drafter proposes k tokens in a chain: the first from its entry for the last verified
   position (target features + the last verified token), each next one from its own hidden
   output (pre-norm; post-norm with ``norm_output``, ``Eagle3Drafter.carry``) and the token it
   just proposed;
2. the target scores ``[last verified token, d_1 .. d_k]`` in one forward pass over its KV cache;
3. the longest prefix of drafts equal to the target's greedy choices is accepted, plus the
   target's own next token (the "bonus"); the target cache is cropped to what was accepted and
   the drafter's cache gets real entries (target features) for the accepted positions.

The output is therefore exactly what greedy decoding of the target produces (up to float
ties), which ``evaluate_acceptance(check_greedy=True)`` verifies.

A draft whose two best logits lie within a few float32 rounding steps of each other (a near-tie,
``TIE_ULPS``) is decided by the order in which kernels sum the same products, so an engine that
runs the very same weights may draft the other token there and count other steps. The decoder
records each near-tie (``SpecResult.ties``, ``AcceptanceReport.near_ties``) and can settle any of
them the other way (``flips``); ``tie_outcomes`` lists every decode a prompt's near-ties allow.

Acceptance length follows SGLang: accepted draft tokens + 1 per verification step; the figure
without the bonus is the one SpecForge's ``simulated_acc_len`` reports.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from eagle3_assets.drafter.model import Eagle3Drafter, KVCache, build_drafter
from eagle3_assets.target.layers import hf_hidden_states_index

# ----------------------------------------------------------------------------- target features


def aux_from_hidden_states(hidden_states, layer_ids: list[int]) -> torch.Tensor:
    """Concat of the aux layer outputs [B, T, 3H] from HF ``output_hidden_states``."""
    n_layers = len(hidden_states) - 1
    return torch.cat([hidden_states[hf_hidden_states_index(i, n_layers)] for i in layer_ids], dim=-1)


@torch.no_grad()
def target_features(model, sequences: list[list[int]], loss_masks: list[list[int]], layer_ids: list[int],
                    *, batch_size: int = 8) -> list[dict]:
    """Training features of whole sequences (prompt + completion) from the HF target:
    ``input_ids``, ``loss_mask``, ``aux_hidden`` [T, 3H], ``last_hidden`` [T, H] (post-norm)."""
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(sequences), batch_size):
        chunk, masks = sequences[i: i + batch_size], loss_masks[i: i + batch_size]
        width = max(len(s) for s in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        att = torch.zeros(len(chunk), width, dtype=torch.long)
        for j, s in enumerate(chunk):  # right padding: real positions are those of the sequence alone
            ids[j, : len(s)] = torch.tensor(s)
            att[j, : len(s)] = 1
        kw = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        res = model(input_ids=ids.to(device), attention_mask=att.to(device), output_hidden_states=True,
                    use_cache=False, **kw)  # the features need no logits
        aux = aux_from_hidden_states(res.hidden_states, layer_ids).float().cpu()
        last = res.hidden_states[-1].float().cpu()
        for j, s in enumerate(chunk):
            n = len(s)
            out.append({
                "input_ids": torch.tensor(s, dtype=torch.long),
                "loss_mask": torch.tensor(masks[j], dtype=torch.long),
                "aux_hidden": aux[j, :n].clone(),
                "last_hidden": last[j, :n].clone(),
            })
    return out


# ----------------------------------------------------------------------------- decoding


def _call(target, ids: list[list[int]], cache=None, hidden: bool = False):
    """One cached forward pass -> (output, cache); transformers >= 5.2x names the cache
    argument ``cache``, older versions ``past_key_values``."""
    name = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    device = next(target.parameters()).device
    kw = {name: cache} if cache is not None else {}
    out = target(input_ids=torch.tensor(ids, device=device), use_cache=True, output_hidden_states=hidden, **kw)
    return out, getattr(out, name)


def _crop(cache, keep: int) -> None:
    """Drop every cached position from ``keep`` on (crop's argument changed meaning in transformers 5)."""
    remove = cache.get_seq_length() - keep
    if remove <= 0:
        return
    if "tokens_to_remove" in inspect.signature(cache.crop).parameters:
        cache.crop(-remove)
    else:
        cache.crop(keep)


@dataclass
class SpecResult:
    output_ids: list[int]  # completion, cut at the first stop token (included) or max_new_tokens
    accepted: list[int]  # per verification step: draft tokens the target agreed with (0..k)
    emitted: list[int]  # per verification step: tokens appended to the output (after the cut)
    finish_reason: str
    ties: list[int] = field(default_factory=list)  # near-tie drafts: draft call index (the replay: its step)


# Two logits this many units in the last place apart (float32, at the larger one's magnitude) are a
# near-tie. The kimi-mini MLA drafter of the engine tests met one two units apart (9.5e-7 at 4.03),
# which vLLM and SGLang both settled the other way.
TIE_ULPS = 8


def near_tie_mask(logits: torch.Tensor) -> torch.Tensor:
    """For each row of draft logits ``[..., V]``: whether its two best logits are a near-tie."""
    top = logits.float().topk(2, dim=-1).values
    scale = top[..., 0].abs().clamp(min=1.0) * torch.finfo(logits.dtype).eps
    return (top[..., 0] - top[..., 1]) <= TIE_ULPS * scale


def draft_index(logits: torch.Tensor, call: int, ties: list[int], flips: frozenset[int]) -> torch.Tensor:
    """The draft-vocabulary index one row of logits drafts: its best, or its runner-up where
    ``call`` is a near-tie settled the other way (``flips``); a near-tie is recorded in ``ties``."""
    best = logits.argmax()
    if bool(near_tie_mask(logits)):
        ties.append(call)
        if call in flips:  # the other of the two best (an exact tie may list argmax's pick second)
            first, second = logits.topk(2).indices
            return second if first == best else first
    return best


@torch.no_grad()
def greedy_generate(target, prompt_ids: list[int], *, max_new_tokens: int, stop_ids: list[int]) -> list[int]:
    """Plain greedy decoding of the target, one token per forward pass over its KV cache."""
    out, cache = _call(target, [prompt_ids])
    ids, tok = [], int(out.logits[0, -1].argmax())
    while True:
        ids.append(tok)
        if tok in stop_ids or len(ids) >= max_new_tokens:
            return ids
        out, cache = _call(target, [[tok]], cache)
        tok = int(out.logits[0, -1].argmax())


@torch.no_grad()
def speculative_generate(
    target,
    drafter: Eagle3Drafter,
    prompt_ids: list[int],
    *,
    k: int,
    max_new_tokens: int,
    stop_ids: list[int],
    layer_ids: list[int] | None = None,
    flips: frozenset[int] = frozenset(),
) -> SpecResult:
    """Greedy chain speculative decoding of one prompt; see the module docstring. ``flips``: draft
    calls (by index in this decode) whose near-tie is settled for the runner-up."""
    device = next(target.parameters()).device
    layer_ids = layer_ids or drafter.config.aux_layer_ids
    stops = set(stop_ids)
    drafter.eval()

    def draft_entries(tokens: list[int], feats: torch.Tensor, start: int) -> torch.Tensor:
        """Real drafter entries for positions start.. : target features + the following token."""
        pos = torch.arange(start, start + len(tokens), device=device)[None]
        hidden = drafter.project_aux(feats.to(drafter.fc.weight.dtype))
        return drafter.step(torch.tensor([tokens], device=device), hidden, pos, dcache)

    out, cache = _call(target, [prompt_ids], hidden=True)
    tok = int(out.logits[0, -1].argmax())
    output, accepted, emitted = [tok], [], []
    dcache = KVCache()
    n_real = len(prompt_ids)  # drafter entries == tokens the target has processed
    last_h = draft_entries(prompt_ids[1:] + [tok], aux_from_hidden_states(out.hidden_states, layer_ids), 0)[:, -1:]
    finish = "stop" if tok in stops else ("length" if len(output) >= max_new_tokens else None)
    ties: list[int] = []
    calls = 0

    while finish is None:
        # 1. draft a chain of k tokens
        drafts, h = [], last_h
        for j in range(k):
            d = int(drafter.draft_to_target(draft_index(drafter.logits(h)[0, -1], calls, ties, flips)))
            calls += 1
            drafts.append(d)
            if j + 1 < k:
                pos = torch.tensor([[n_real + j]], device=device)  # the chain's j-th token sits at n_real + j
                h = drafter.step(torch.tensor([[d]], device=device), drafter.carry(h), pos, dcache)
        dcache.truncate(n_real)
        # 2. verify in one target pass
        out, cache = _call(target, [[tok, *drafts]], cache, hidden=True)
        preds = out.logits[0].argmax(-1).tolist()
        m = 0
        while m < k and drafts[m] == preds[m]:
            m += 1
        new = drafts[:m] + [preds[m]]
        _crop(cache, n_real + 1 + m)  # keep the last verified token and the accepted drafts
        # 3. real drafter entries for the newly verified positions
        feats = aux_from_hidden_states(out.hidden_states, layer_ids)[:, : 1 + m]
        last_h = draft_entries(new, feats, n_real)[:, -1:]
        n_real += 1 + m
        tok = new[-1]
        accepted.append(m)
        take, finish = emit_verified(new, len(output), stops, max_new_tokens)
        output.extend(take)
        emitted.append(len(take))
    return SpecResult(output, accepted, emitted, finish, ties)


def tie_outcomes(target, drafter: Eagle3Drafter, prompt_ids: list[int], *, k: int, max_new_tokens: int,
                 stop_ids: list[int], max_flips: int = 3) -> list[SpecResult]:
    """Every decode of one prompt its near-ties allow, the plain one first: each near-tie met on the
    way settled either way, at most ``max_flips`` of them the other way. An engine that sums in
    another order runs one of these (its output stays greedy: verification decides what is emitted)."""
    outcomes, pending = [], [frozenset()]
    while pending:
        flips = pending.pop(0)
        res = speculative_generate(target, drafter, prompt_ids, k=k, max_new_tokens=max_new_tokens,
                                   stop_ids=stop_ids, flips=flips)
        outcomes.append(res)
        if len(flips) < max_flips:
            pending += [flips | {t} for t in res.ties if t > max(flips, default=-1)]
    return outcomes


def emit_verified(new: list[int], produced: int, stops: set[int], max_new_tokens: int) -> tuple[list[int], str | None]:
    """The tokens one verification emits (accepted drafts, then the bonus token), cut at the first
    stop id or at ``max_new_tokens`` (``produced`` already out), and why decoding ends, if it does.
    Shared by the decoder and the replay evaluator so both end a reply by the same rule."""
    take: list[int] = []
    for t in new:
        take.append(t)
        if t in stops:
            return take, "stop"
        if produced + len(take) >= max_new_tokens:
            return take, "length"
    return take, None


# ----------------------------------------------------------------------------- the report


@dataclass
class AcceptanceReport:
    k: int
    prompts: int
    verify_steps: int
    output_tokens: int  # all completion tokens, the prefill's first token included
    acceptance_length: float  # SGLang: mean over verification steps of (accepted + 1)
    acceptance_length_no_bonus: float  # mean accepted draft tokens per verification step
    tokens_per_verification: float  # tokens actually emitted per verification step (cut at the end)
    per_position_rate: list[float]  # P(draft token j accepted), j = 1..k
    conditional_rate: list[float]  # P(token j accepted | tokens 1..j-1 accepted)
    accepted_histogram: list[int]  # verification steps with 0..k accepted
    matches_greedy: bool | None = None  # every output equals plain greedy decoding
    near_ties: int = 0  # drafts decided by a near-tie (TIE_ULPS): where another engine may draft otherwise
    outputs: list[list[int]] = field(default_factory=list)

    def as_metadata(self) -> dict:
        """Everything but the decoded ids, for logs and Dagster metadata."""
        return {k: v for k, v in self.__dict__.items() if k != "outputs"}


def acceptance_report(results: list[SpecResult], k: int) -> AcceptanceReport:
    acc = [a for r in results for a in r.accepted]
    steps = len(acc)
    hist = [sum(1 for a in acc if a == j) for j in range(k + 1)]
    reach = [sum(1 for a in acc if a >= j) for j in range(k + 1)]  # reach[0] == steps
    return AcceptanceReport(
        k=k,
        prompts=len(results),
        verify_steps=steps,
        output_tokens=sum(len(r.output_ids) for r in results),
        acceptance_length=(sum(acc) + steps) / steps if steps else 1.0,
        acceptance_length_no_bonus=sum(acc) / steps if steps else 0.0,
        tokens_per_verification=sum(sum(r.emitted) for r in results) / steps if steps else 0.0,
        per_position_rate=[reach[j] / steps if steps else 0.0 for j in range(1, k + 1)],
        conditional_rate=[reach[j] / reach[j - 1] if reach[j - 1] else 0.0 for j in range(1, k + 1)],
        accepted_histogram=hist,
        near_ties=sum(len(r.ties) for r in results),
        outputs=[r.output_ids for r in results],
    )


def evaluate_acceptance(
    target,
    drafter: Eagle3Drafter,
    prompts: list[list[int]],
    *,
    k: int,
    max_new_tokens: int,
    stop_ids: list[int],
    check_greedy: bool = False,
    greedy_reference: list[list[int]] | None = None,
) -> AcceptanceReport:
    """Speculative decoding over rendered prompts. With ``check_greedy`` (or a precomputed
    ``greedy_reference``, e.g. shared between a drafter and its baseline) ``matches_greedy``
    says whether every output equals plain greedy decoding of the target."""
    results = [speculative_generate(target, drafter, p, k=k, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
               for p in prompts]
    report = acceptance_report(results, k)
    if check_greedy and greedy_reference is None:
        greedy_reference = [greedy_generate(target, p, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
                            for p in prompts]
    if greedy_reference is not None:
        report.matches_greedy = report.outputs == [list(g) for g in greedy_reference]
    return report


def untrained_baseline(drafter: Eagle3Drafter, seed: int = 0) -> Eagle3Drafter:
    """Same architecture, embeddings and vocabulary map, fresh random weights from ``seed``."""
    base = build_drafter(drafter.config, drafter.embed_tokens.weight.detach(), seed=seed)
    base.d2t.copy_(drafter.d2t)
    base.t2d.copy_(drafter.t2d)
    return base.to(drafter.fc.weight.device).eval()
