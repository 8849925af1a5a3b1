"""Preflight in bytes: what the offline path would need, the cap, and whether the cap can work.

The offline path stores every distinct sample once (``estimate_bytes`` of the corpus's tokens).
The spool must hold, at the least, every unit one optimizer step reads (they stay until the
step is taken) plus one unit being captured, plus the plan; a cap below that is refused,
naming the setting. With ``keep`` the whole corpus must fit. The cap must fit the spool's
filesystem too (its free space, plus what the spool holds already): a cap above it is refused
naming the folder and both figures, since the spool could never reach it. The trainer's idle share in the
steady state is ``1 - capture rate / training rate`` when capture is the slower side (and the
producers' the converse), from rates measured or given.
"""

from __future__ import annotations

from pathlib import Path

from eagle3_assets.files import free_bytes, require_free
from eagle3_assets.hidden_states.sizing import estimate_bytes
from eagle3_assets.hidden_states.spool.plan import PLAN
from eagle3_assets.hidden_states.spool.store import tree_bytes

PREFLIGHT = "preflight.json"  # the figures below, written by the trainer beside the plan for the step to show


class CapTooSmall(ValueError):
    """The stream's byte cap cannot hold one optimizer step's units and one unit in capture."""


def stream_preflight(plan, *, spool_dir: Path | None = None, plan_bytes: int | None = None,
                     capture_tokens_per_s: float | None = None, train_tokens_per_s: float | None = None) -> dict:
    """The figures, from the plan before it is written (``plan_bytes``: its JSON's size) or as the spool holds it."""
    d = plan.data
    distinct = {(e[0], e[1]) for e in plan.entries}
    tokens = sum(d["lengths"][ds][sid] for ds, sid in distinct)
    offline = estimate_bytes(tokens, d["hidden_size"], d["dtype"], len(distinct), d["n_aux"])
    if plan_bytes is None:
        plan_bytes = (Path(spool_dir) / PLAN).stat().st_size if spool_dir and (Path(spool_dir) / PLAN).exists() else 0
    step_units = 0
    for lo, hi in plan.steps():
        touched = {plan.unit_at(p).id for p in range(lo, hi)}
        step_units = max(step_units, sum(plan.by_id[u].bytes for u in touched))
    largest = max((u.bytes for u in plan.units), default=0)
    minimum = step_units + largest + plan_bytes + 4096  # + the cursor and lease files
    all_units = sum(u.bytes for u in plan.units) + plan_bytes + 4096
    c, t = capture_tokens_per_s, train_tokens_per_s
    return {
        "offline_bytes": offline, "corpus_tokens": tokens, "corpus_samples": len(distinct),
        "cap_bytes": plan.cap_bytes, "min_cap_bytes": minimum, "keep_bytes": all_units, "mode": d["mode"],
        "units": len(plan.units), "largest_unit_bytes": largest, "step_units_bytes": step_units,
        "captured_tokens": sum(u.tokens for u in plan.units),
        "trainer_idle_share": max(0.0, 1.0 - c / t) if c and t else None,
        "producer_idle_share": max(0.0, 1.0 - t / c) if c and t else None,
        "spool_free_bytes": free_bytes(spool_dir) if spool_dir else None,
        "spool_held_bytes": tree_bytes(spool_dir) if spool_dir else 0,
    }


def preflight_line(f: dict) -> str:
    idle = "unknown (no rates given)" if f["trainer_idle_share"] is None else f"{f['trainer_idle_share']:.0%}"
    return (f"eagle3: stream preflight: offline would store {f['offline_bytes']:,} bytes ({f['corpus_samples']:,} samples, "
            f"{f['corpus_tokens']:,} tokens); cap {f['cap_bytes']:,} bytes (at least {f['min_cap_bytes']:,}: one step's "
            f"units + one in capture); {f['units']} units, mode {f['mode']} captures {f['captured_tokens']:,} tokens; "
            f"estimated trainer idle share {idle}")


def check_disk(f: dict, spool_dir: Path) -> dict:
    """Refuse a cap the spool's filesystem cannot hold (free space + the spool's own bytes), naming both."""
    return require_free(spool_dir, f["cap_bytes"], "the stream's spool (stream.cap_bytes)", held=f["spool_held_bytes"])


def check_cap(f: dict) -> None:
    if f["cap_bytes"] < f["min_cap_bytes"]:
        raise CapTooSmall(f"stream.cap_bytes = {f['cap_bytes']:,} is below {f['min_cap_bytes']:,} bytes: one optimizer "
                          f"step's units ({f['step_units_bytes']:,}) and one unit in capture ({f['largest_unit_bytes']:,}) "
                          "must fit; raise stream.cap_bytes or lower training.batch_size / stream.unit_bytes")
    if f["mode"] == "keep" and f["cap_bytes"] < f["keep_bytes"]:
        raise CapTooSmall(f"stream.epochs = 'keep' keeps every unit ({f['keep_bytes']:,} bytes) but stream.cap_bytes is "
                          f"{f['cap_bytes']:,}: raise the cap or use stream.epochs = 'recapture'")
