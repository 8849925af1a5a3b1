"""Run the sweep: for each engine with a serve role, one server per setting (the baseline first),
each concurrency level and category measured as one batch (at least as many requests as the level),
each cell journaled as it finishes.

The engines come from the registry (``engine_names("serve")``); nothing here names one. An engine
missing from the machine is reported, one that cannot serve the recipe's layout is skipped with the
reason, and a server that dies mid-sweep is started again (``restarts`` times per setting) and
measures only the cells the journal does not hold yet.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_assets.serving.journal import Journal
from eagle3_assets.serving.plan import Setting, plan_cells, settings_for
from eagle3_assets.serving.provenance import cell_key, export_sha256
from eagle3_assets.serving.timing import Timed, batch_figures


@dataclass
class SweepSpec:
    chains: list[int] = field(default_factory=lambda: [1, 3])
    trees: list[tuple[int, int, int]] = field(default_factory=list)  # (steps, topk, draft_tokens)
    concurrency: list[int] = field(default_factory=lambda: [1, 4])
    max_new_tokens: int = 32
    engines: list[str] = field(default_factory=list)  # empty: every engine with a serve role
    restarts: int = 2  # per setting, after a server died
    pythons: dict[str, str] = field(default_factory=dict)  # engine -> its interpreter ("": the engine's default)
    timeout_s: float = 900.0


@dataclass
class Bench:
    """What is served: the prompts (rendered), the target, the recipe's drafter folder."""

    prompts: list  # BenchPrompt
    ids: list[list[int]]
    bench_hash: str
    model_dir: Path
    drafter_dir: Path
    target_id: str
    machine: str
    stop_ids: list[int] = field(default_factory=list)

    def categories(self) -> list[str]:
        return list(dict.fromkeys(p.category for p in self.prompts))


@dataclass
class SweepOutcome:
    entries: list[dict] = field(default_factory=list)  # the journal lines of every planned cell measured
    missing: dict[str, str] = field(default_factory=dict)  # engine -> why it is not on this machine
    skipped: dict[str, str] = field(default_factory=dict)  # engine or "engine setting" -> why it was not served
    notes: list[str] = field(default_factory=list)
    reused: int = 0
    measured: int = 0
    restarts: int = 0
    wall_s: float = 0.0


def _roles(names: list[str]) -> dict:
    from eagle3_assets.engines import engine_names, engine_role

    known = engine_names("serve")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"no serve role for {unknown}; the engines that serve: {list(known)}")
    return {n: engine_role("serve", n) for n in (names or known)}


def run_sweep(bench: Bench, spec: SweepSpec, journal: Journal, *, roles: dict | None = None,
              log: Callable[[str], None] = print) -> SweepOutcome:
    t0 = time.perf_counter()
    out = SweepOutcome()
    for engine, role in (roles if roles is not None else _roles(spec.engines)).items():
        python = spec.pythons.get(engine, "")
        why = role.missing(python)
        if why:
            out.missing[engine] = why
            log(f"{engine}: not on this machine: {why}")
            continue
        export = bench.drafter_dir / engine
        why = (f"the recipe has no {engine} export ({export})" if not (export / "config.json").exists()
               else role.problem(bench.model_dir, export, python))
        if why:
            out.skipped[engine] = why
            log(f"{engine}: skipped: {why}")
            continue
        settings, notes = settings_for(spec.chains, spec.trees, takes_trees=role.takes_trees)
        out.notes += [f"{engine}: {n}" for n in notes]
        ctx = {"engine": engine, "engine_version": role.version(python), "export_sha256": export_sha256(export)}
        for setting in settings:
            _serve_setting(bench, spec, journal, role, python, export, setting, ctx, out, log)
    out.wall_s = time.perf_counter() - t0
    return out


def _serve_setting(bench, spec, journal, role, python, export, setting: Setting, ctx, out, log) -> None:
    cells = plan_cells(ctx["engine"], [setting], spec.concurrency, bench.categories())
    keys = {c.key: cell_key(c, export_sha=ctx["export_sha256"], engine_version=ctx["engine_version"],
                            bench_hash=bench.bench_hash, machine_name=bench.machine, max_new_tokens=spec.max_new_tokens,
                            target_id=bench.target_id) for c in cells}
    todo = [c for c in cells if not journal.has(keys[c.key])]
    out.reused += len(cells) - len(todo)
    out.entries += [journal.get(keys[c.key]) for c in cells if journal.has(keys[c.key])]
    if not todo:
        return
    tries = 0
    while todo:
        server = role.server(bench.model_dir, None if setting.baseline else export, k=setting.steps, python=python,
                             topk=setting.topk, draft_tokens=setting.draft_tokens)
        try:
            with server:
                url, command = role.url(server), shlex.join(server.command())
                log(f"{ctx['engine']} {setting.label}: serving at {url}")
                _warm_up(role, url, bench, spec)
                while todo:
                    cell = todo[0]
                    entry = measure_cell(role, url, bench, spec, cell, keys[cell.key],
                                         {**ctx, "serve_command": command, "bench_hash": bench.bench_hash,
                                          "machine": bench.machine, "baseline": setting.baseline})
                    journal.add(entry)
                    out.entries.append(entry)
                    out.measured += 1
                    todo.pop(0)
                    log(f"  {cell.key}: {entry['figures']['tokens_per_s']:.2f} tokens/s")
        except Exception as e:  # the server died, or never came up
            tries += 1
            if tries > spec.restarts:
                out.skipped[f"{ctx['engine']} {setting.label}"] = f"failed {tries} times, last: {str(e)[:400]}"
                log(f"{ctx['engine']} {setting.label}: given up after {tries} tries: {e}")
                return
            out.restarts += 1
            log(f"{ctx['engine']} {setting.label}: the server failed ({str(e)[:200]}); starting it again, "
                f"{len(cells) - len(todo)} cells kept")


def _client(spec):
    import httpx

    return httpx.Client(timeout=httpx.Timeout(spec.timeout_s, connect=30.0))


def _warm_up(role, url, bench, spec) -> None:
    """One short request first: a fresh server's first step pays for lazy setup no later step pays."""
    with _client(spec) as client:
        role.timed(client, url, bench.ids[0], max_new_tokens=4, stop_token_ids=bench.stop_ids)


def cell_requests(chosen: list, concurrency: int) -> list:
    """A cell's requests: its category's prompts, cycled to at least ``concurrency`` of them, so the
    level is reached even where a category holds fewer prompts than requests in flight."""
    if not chosen:
        return []
    return [chosen[i % len(chosen)] for i in range(max(len(chosen), concurrency))]


def measure_cell(role, url: str, bench: Bench, spec: SweepSpec, cell, key: str, provenance: dict) -> dict:
    """One category's prompts at the cell's concurrency: timings, outputs, the engine's counters."""
    chosen = cell_requests([(p, ids) for p, ids in zip(bench.prompts, bench.ids) if p.category == cell.category],
                           cell.concurrency)
    with _client(spec) as client:
        before = role.counters(client, url)

        def one(item) -> tuple:
            p, ids = item
            return p, role.timed(client, url, ids, max_new_tokens=spec.max_new_tokens, stop_token_ids=bench.stop_ids)

        with ThreadPoolExecutor(max_workers=cell.concurrency) as pool:
            replies = list(pool.map(one, chosen))
        after = role.counters(client, url)
    timed = [Timed(p.prompt_id, r.sent, r.arrivals, r.output_ids, r.meta) for p, r in replies]
    acceptance = None if cell.setting.baseline else role.batch_acceptance(before, after, [r for _, r in replies],
                                                                          cell.setting.steps)
    outputs: dict[str, list[int]] = {}
    copies: dict[str, list[list[int]]] = {}  # a prompt sent again to fill the level: each later reply
    for t in timed:
        if t.prompt_id in outputs:
            copies.setdefault(t.prompt_id, []).append(t.output_ids)
        else:
            outputs[t.prompt_id] = t.output_ids
    return {"key": key, "engine": cell.engine, "setting": cell.setting.as_dict(), "label": cell.setting.label,
            "concurrency": cell.concurrency, "category": cell.category, "figures": batch_figures(timed),
            "acceptance": acceptance, "outputs": outputs, "copy_outputs": copies, "provenance": provenance}
