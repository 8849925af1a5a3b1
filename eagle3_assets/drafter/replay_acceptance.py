"""Chain acceptance without decoding: one target prefill per prompt, one TTT pass of the drafter.

Greedy speculative decoding emits exactly the target's greedy reply, so every state the real
decoder (:func:`~eagle3_assets.drafter.spec_decode.speculative_generate`) ever sees is known
before it runs: the target's features at each position are those of one prefill over
``prompt + reply``, and the drafter's chain drafted after position t reads, as long as its
drafts are accepted, the reply's own tokens. The training-time-test forward pass with the
reply as its tokens (``Eagle3Drafter.forward``, the same attention the chain sees) therefore
gives, at every position t at once, the drafts of a chain started there; the number of
leading drafts equal to the reply is the accepted length a_t. Walking the verification
steps t -> t + a_t + 1 from the reply's start, with the real decoder's stop and length
rules, gives the same verification steps and the same acceptance length (up to float ties
between the two ways of computing the same numbers).

The target's part (:func:`replay_inputs`) does not depend on the drafter: computed once, it
lets a screening run score a drafter on every held-out prompt in seconds instead of the
real decoder's minutes. The real decoder stays the asset's measure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3_assets.drafter.model import Eagle3Drafter
from eagle3_assets.drafter.spec_decode import (
    AcceptanceReport,
    SpecResult,
    _call,
    acceptance_report,
    aux_from_hidden_states,
    emit_verified,
    near_tie_mask,
)


@dataclass
class ReplayInput:
    """One held-out prompt as the target sees it: ``ids`` = prompt + greedy reply + ``lookahead``
    more greedy tokens (the real decoder compares drafts past the reply's end on its last
    step), ``aux`` [len(ids), 3H] the target's features (zero on the lookahead, never read)."""

    prompt_len: int
    reply_len: int
    ids: torch.Tensor
    aux: torch.Tensor
    greedy_mismatches: int  # reply tokens the prefill's argmax disagrees with (float ties); 0 normally


@torch.no_grad()
def replay_inputs(target, prompts: list[list[int]], replies: list[list[int]], layer_ids: list[int], *,
                  lookahead: int) -> list[ReplayInput]:
    """The target's part of the replay for each (prompt, greedy reply): one prefill over both,
    then ``lookahead`` incremental greedy steps past the reply (``lookahead >= k``)."""
    out = []
    for prompt, reply in zip(prompts, replies):
        seq = list(prompt) + list(reply)
        res, cache = _call(target, [seq], hidden=True)
        argmax = res.logits[0, len(prompt) - 1: -1].argmax(-1).tolist()  # the target's choice for each reply token
        mismatches = sum(a != b for a, b in zip(argmax, reply))
        aux = aux_from_hidden_states(res.hidden_states, layer_ids)[0].float().cpu()
        extra, tok = [], int(res.logits[0, -1].argmax())
        for _ in range(lookahead):
            extra.append(tok)
            res, cache = _call(target, [[tok]], cache)
            tok = int(res.logits[0, -1].argmax())
        aux = torch.cat([aux, aux.new_zeros(len(extra), aux.shape[-1])])
        out.append(ReplayInput(len(prompt), len(reply), torch.tensor(seq + extra, dtype=torch.long), aux, mismatches))
    return out


@torch.no_grad()
def accepted_lengths(drafter: Eagle3Drafter, item: ReplayInput, k: int) -> list[int]:
    """a_t for every position t: leading drafts of the chain started after t that equal the
    sequence's own next tokens (the chain's step s at t drafts the token at t + 2 + s)."""
    return chains(drafter, item, k)[0]


@torch.no_grad()
def chains(drafter: Eagle3Drafter, item: ReplayInput, k: int) -> tuple[list[int], list[int]]:
    """``(a_t, ties_t)`` for every position t: the accepted length, and how many of the drafts the
    verification at t compares (the accepted ones and the first rejected one) are near-ties."""
    ids, dtype = item.ids, drafter.fc.weight.dtype
    logits = drafter(ids[None], item.aux[None].to(dtype), ttt_steps=k)
    n = ids.numel()
    run = torch.ones(n, dtype=torch.bool)
    accepted = torch.zeros(n, dtype=torch.long)
    ties = torch.zeros(n, dtype=torch.long)
    for s, step in enumerate(logits):
        draft = drafter.draft_to_target(step[0].argmax(-1))  # [n]
        truth = torch.full((n,), -1, dtype=torch.long)
        truth[: max(0, n - 2 - s)] = ids[2 + s:]
        ties += (run & near_tie_mask(step[0])).long()  # compared: every draft up to the first miss
        run &= draft == truth
        accepted += run.long()
    return accepted.tolist(), ties.tolist()


def replay_one(drafter: Eagle3Drafter, item: ReplayInput, *, k: int, max_new_tokens: int,
               stop_ids: list[int]) -> SpecResult:
    """The real decoder's verification steps, walked over the accepted lengths."""
    if item.ids.numel() < item.prompt_len + item.reply_len + k:
        raise ValueError(f"the replay needs {k} lookahead tokens past the reply for k={k}")
    a, tie_counts = chains(drafter, item, k)
    ids, stops = item.ids.tolist(), set(stop_ids)
    ties: list[int] = []
    n_real = item.prompt_len  # tokens the target has processed; ids[n_real] is the last verified token
    output, accepted, emitted = [ids[n_real]], [], []
    finish = "stop" if output[0] in stops else ("length" if len(output) >= max_new_tokens else None)
    while finish is None:
        m = a[n_real - 1]
        ties += [len(accepted)] * tie_counts[n_real - 1]
        new = ids[n_real + 1: n_real + 2 + m]  # the accepted drafts and the target's bonus token
        take, finish = emit_verified(new, len(output), stops, max_new_tokens)
        n_real += 1 + m
        accepted.append(m)
        output.extend(take)
        emitted.append(len(take))
    return SpecResult(output, accepted, emitted, finish, ties)


def replay_acceptance(drafter: Eagle3Drafter, items: list[ReplayInput], *, k: int, max_new_tokens: int,
                      stop_ids: list[int]) -> AcceptanceReport:
    """The acceptance report the real decoder would give on these prompts, from the replay;
    ``matches_greedy`` says whether each walk emitted the greedy reply it was given."""
    drafter.eval()
    results = [replay_one(drafter, it, k=k, max_new_tokens=max_new_tokens, stop_ids=stop_ids) for it in items]
    report = acceptance_report(results, k)
    report.matches_greedy = all(r.output_ids == it.ids[it.prompt_len: it.prompt_len + it.reply_len].tolist()
                                for r, it in zip(results, items))
    return report
