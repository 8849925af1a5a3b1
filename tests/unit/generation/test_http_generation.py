"""The HTTP generation engine against real loopback servers on 127.0.0.1.

Tests that claim real tokens use the embedded model behind the loopback; the rest use the
synthetic mode (fake ids) where model output is not the point.
"""

import asyncio
import json
import logging
import math
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from eagle3_assets.engines.http.samples import SamplingSettings, plan_samples
from eagle3_assets.engines.openrouter.backend import OpenRouterBackend
from eagle3_assets.engines.sglang.backend import SGLangBackend
from eagle3_assets.generation.budget import TokenBudget
from eagle3_assets.generation.http_engine import (
    BackendUnavailable,
    ClientConfig,
    Prices,
    RetryPolicy,
    RunStopped,
    classify,
    classify_exception,
    plan_remaining,
    raise_for_stop,
    run_generation,
)
from eagle3_assets.generation.response_store import RESPONSE_FIELDS, ResponseStore
from eagle3_assets.loopback import (
    FaultPlan,
    ModelGenerator,
    OpenRouterApp,
    SGLangApp,
    SyntheticGenerator,
    messages_key,
)
from eagle3_assets.prompts.reader import Prompt
from tests.conftest import small_prompts

KEY = "sk-or-v1-" + secrets.token_hex(24)
FAST = RetryPolicy(max_attempts=6, base_delay_s=0.01, max_delay_s=0.05, cooldown_s=0.05, seed=0)
REPO = Path(__file__).resolve().parents[3]


def make_requests(n, dataset="ds", target="t", prefix="q"):
    prompts = [Prompt(p["id"], p["messages"], i + 1) for i, p in enumerate(small_prompts(n, prefix))]
    sampling = SamplingSettings(target)
    return plan_samples(dataset, prompts, sampling), sampling


def run(reqs, backend, store, sampling, budget=None, **kw):
    kw.setdefault("retry", FAST)
    kw.setdefault("max_tokens", 16)
    kw.setdefault("concurrency", 8)
    budget = budget if budget is not None else TokenBudget(10**9)
    return asyncio.run(run_generation(reqs, backend, store, budget, sampling=sampling, **kw))


def ids_of(store):
    return [r["sample_id"] for r in store.rows()]


@pytest.fixture
def one_torch_thread():
    """The loopback model shares 2 cores with the client and pytest: one intra-op thread avoids
    oversubscription (measured 1-2 s instead of ~30 s per batch on a busy 2-core machine)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def openrouter(srv, key=KEY, **kw):
    return OpenRouterBackend(key, "moonshotai/kimi-k2.5", base_url=srv.url + "/api/v1", **kw)


# ---------------------------------------------------------------------------------------------
# classify(): a table of replies

OK_CHAT = {"id": "gen-1", "choices": [{"finish_reason": "stop", "message": {"content": "hi"}}], "usage": {"cost": 1e-6}}
ERR = lambda code, **meta: {"error": {"code": code, "message": "m", **({"metadata": meta} if meta else {})}}  # noqa: E731
SGL = lambda fr: {"text": "x", "output_ids": [1, 2], "meta_info": {"id": "r", "finish_reason": fr}}  # noqa: E731

CASES = [
    # status, body, headers, kind, reason, retry_after, cooldown
    (200, OK_CHAT, None, "ok", "stop", None, False),
    (200, b"\n\n\n" + json.dumps(OK_CHAT).encode(), None, "ok", "stop", None, False),  # heartbeats
    (200, {"choices": [{"finish_reason": "length", "message": {}}]}, None, "ok", "length", None, False),
    (200, b"\n\n", None, "retry", "invalid_body", None, False),
    (200, b"<html>oops", None, "retry", "invalid_body", None, False),
    (200, ERR(502, error_type="provider_unavailable"), None, "retry", "error_in_body", None, False),
    (200, {"error": "upstream failed"}, None, "retry", "error_in_body", None, False),
    (200, ERR(400), None, "fail", "error_in_body_400", None, False),
    (200, ERR(401), None, "stop", "unauthorized", None, False),
    (200, {"choices": [{"finish_reason": "error", "message": {"content": "par"}}]}, None, "retry", "finish_error", None, False),
    (200, {"choices": [{"finish_reason": "stop", "error": {"code": 502, "message": "x"}}]}, None,
     "retry", "finish_error", None, False),
    (200, {"choices": [{"finish_reason": None, "message": {}}]}, None, "retry", "no_finish_reason", None, False),
    (200, {"choices": []}, None, "retry", "no_choices", None, False),
    (200, {"choices": [{"finish_reason": "content_filter", "message": {}}]}, None, "fail", "content_filter", None, False),
    (200, SGL({"type": "stop", "matched": 2}), None, "ok", "stop", None, False),
    (200, SGL({"type": "length", "length": 16}), None, "ok", "length", None, False),
    (200, [SGL({"type": "stop", "matched": 2})], None, "ok", "stop", None, False),
    (200, SGL({"type": "abort", "message": "x", "status_code": 500}), None, "retry", "abort", None, False),
    (200, SGL({"type": "abort", "message": "too long", "status_code": 400}), None, "fail", "abort_400", None, False),
    (200, SGL(None), None, "retry", "no_finish_reason", None, False),
    (200, {"something": "else"}, None, "fail", "unrecognized_body", None, False),
    (401, ERR(401), None, "stop", "unauthorized", None, False),
    (402, ERR(402, limit_source="openrouter_in_flight_budget"), {"Retry-After": "3"}, "retry", "in_flight_budget", 3.0, True),
    (402, ERR(402, limit_source="openrouter_credits"), None, "stop", "credits", None, False),
    (402, ERR(402, limit_source="openrouter_key_limit"), None, "stop", "key_limit", None, False),
    (402, b"", None, "stop", "credits", None, False),
    (408, ERR(408), None, "retry", "http_408", None, False),
    (429, ERR(429), {"retry-after": "7"}, "retry", "rate_limited", 7.0, True),
    (429, {"error": {"code": 429, "message": "m", "availability": {"retry_after": 2}}}, None,
     "retry", "rate_limited", 2.0, True),
    (429, b"", None, "retry", "rate_limited", None, True),
    (500, ERR(500), None, "retry", "http_500", None, False),
    (502, b"<html>bad gateway</html>", None, "retry", "http_502", None, False),
    (503, ERR(503), {"Retry-After": "1.5"}, "retry", "http_503", 1.5, False),
    (524, b"", None, "retry", "http_524", None, False),
    (529, ERR(529), None, "retry", "http_529", None, False),
    (400, ERR(400, error_type="context_length_exceeded"), None, "fail", "http_400", None, False),
    (403, ERR(403, reasons=["x"]), None, "fail", "http_403", None, False),
    (404, ERR(404), None, "fail", "http_404", None, False),
]


@pytest.mark.parametrize("status,body,headers,kind,reason,retry_after,cooldown", CASES)
def test_classify_table(status, body, headers, kind, reason, retry_after, cooldown):
    out = classify(status, body, headers)
    assert (out.kind, out.reason, out.retry_after, out.cooldown) == (kind, reason, retry_after, cooldown)


def test_classify_retry_after_http_date_and_exceptions():
    when = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    out = classify(429, b"", httpx.Headers({"Retry-After": when}))
    assert out.kind == "retry" and 25 <= out.retry_after <= 31
    req = httpx.Request("POST", "http://127.0.0.1/x")
    assert classify_exception(httpx.ReadTimeout("t", request=req)).reason == "timeout"
    assert classify_exception(httpx.RemoteProtocolError("Server disconnected", request=req)).reason == "disconnected"
    assert classify_exception(httpx.ConnectError("refused", request=req)).reason == "connect_error"
    assert classify_exception(TimeoutError()).reason == "attempt_timeout"
    assert all(classify_exception(e).kind == "retry" for e in [OSError("x"), httpx.ReadError("x", request=req)])


def test_sglang_prefix_bug_repair_and_mismatch_flag():
    reqs, sampling = make_requests(1)
    be = SGLangBackend("http://127.0.0.1:1", lambda m: [1, 2, 3, 4, 5, 6, 7], repair_prefix_bug=True)
    prep = be.prepare(reqs[0], max_tokens=8, sampling=sampling)
    rid = f"{reqs[0].sample_id}-1"

    def body(output_ids, ct):
        return json.dumps({"text": "ab", "output_ids": output_ids, "meta_info": {
            "id": rid, "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 7, "completion_tokens": ct}}).encode()

    p = be.parse(prep, 200, {}, body([4, 5, 6, 7, 10, 11, 2], 3), latency_s=0.1, attempts=1, base_url="u")
    assert p.outcome.ok and p.row["output_ids"] == [10, 11, 2] and p.flags == ("prefix_repaired",)
    p = be.parse(prep, 200, {}, body([9, 9, 10, 11, 2], 3), latency_s=0.1, attempts=1, base_url="u")
    assert (p.outcome.kind, p.outcome.reason) == ("fail", "output_ids_mismatch")
    p = be.parse(prep, 200, {}, body([10, 11, 2], 3), latency_s=0.1, attempts=1, base_url="u")
    assert p.outcome.ok and p.flags == () and set(RESPONSE_FIELDS) <= set(p.row)


# ---------------------------------------------------------------------------------------------
# real tokens: the embedded model behind both protocols


@pytest.mark.model
def test_sglang_real_model_rows_token_exact(embedded, tmp_path, serve, one_torch_thread):
    srv = serve(SGLangApp(ModelGenerator(embedded), prefix_bug=0.5, seed=3))
    reqs, sampling = make_requests(4, target=embedded.name)
    store = ResponseStore(tmp_path / "r")
    backend = SGLangBackend([srv.url], embedded.render_prompt, repair_prefix_bug=True)
    rep = run(reqs, backend, store, sampling, max_tokens=12, concurrency=4)
    rows = store.rows()
    assert rep.new == 4 and rep.errors == 0 and rep.stopped_reason is None
    assert rep.backend_info["model_info"]["model_path"] == embedded.name
    stats = srv.stats()
    assert stats["prefix_bug_injected"] > 0 and rep.flags["prefix_repaired"] == stats["prefix_bug_injected"]
    assert sorted(stats["generated"]) == sorted(r.sample_id for r in reqs)  # rid carries the sample id
    by_id = {r.sample_id: r for r in reqs}
    for row in rows:
        assert set(row) == set(RESPONSE_FIELDS) and row["source"] == "sglang" and row["model"] == embedded.name
        assert row["prompt_ids"] == embedded.render_prompt(by_id[row["sample_id"]].messages)
        assert len(row["output_ids"]) == row["completion_tokens"] and row["prompt_tokens"] == len(row["prompt_ids"])
        assert embedded.tokenizer.decode(row["output_ids"], skip_special_tokens=True) == row["text"]
        assert row["finish_reason"] in ("stop", "length") and row["cost_usd"] == 0.0 and row["provider"] == srv.url
        if row["finish_reason"] == "stop":
            assert row["output_ids"][-1] in embedded.stop_ids
        else:
            assert len(row["output_ids"]) == 12
    # greedy output of the HTTP path is the embedded model's own
    first = by_id[rows[0]["sample_id"]]
    direct = embedded.generate([embedded.render_prompt(first.messages)], max_new_tokens=12)[0]
    assert rows[0]["output_ids"] == direct.output_ids


@pytest.mark.model
def test_openrouter_real_model_faults_reasoning_and_exact_costs(embedded, tmp_path, serve, one_torch_thread):
    script = "heartbeat,429,error200,finish_error,502,drop,402inflight,heartbeat,ok,ok,ok,ok,ok,ok"
    app = OpenRouterApp(ModelGenerator(embedded), api_key=KEY,
                        faults=FaultPlan.from_strings(script=script, retry_after_s=0.05, heartbeats=2))
    srv = serve(app)
    reqs, sampling = make_requests(4, target=embedded.name)
    store = ResponseStore(tmp_path / "r")
    be = openrouter(srv, reasoning={"effort": "low"}, provider={"order": ["loopback"], "allow_fallbacks": False})
    rep = run(reqs, be, store, sampling, max_tokens=12, concurrency=2,
              retry=RetryPolicy(max_attempts=10, base_delay_s=0.01, max_delay_s=0.05, cooldown_s=0.05, seed=0))
    rows = store.rows()
    stats = srv.stats()
    assert rep.new == 4 and rep.errors == 0
    assert rep.retries == {"rate_limited": 1, "error_in_body": 1, "finish_error": 1, "http_502": 1,
                           "disconnected": 1, "in_flight_budget": 1}
    # dollars: the rows' usage.cost add up exactly to what the server billed, and to /key's usage
    assert math.fsum(r["cost_usd"] for r in rows) == stats["billed_usd"] == rep.cost_usd > 0
    assert rep.backend_info["key_usage_delta"] == pytest.approx(stats["billed_usd"], abs=1e-15)
    assert rep.cost_usd_failed == 0.0  # failed attempts are not billed (zero-completion insurance)
    assert sum(r["completion_tokens"] for r in rows) == stats["completion_tokens_billed"] == rep.completion_tokens
    for row in rows:
        assert set(row) == set(RESPONSE_FIELDS) and row["source"] == "openrouter"
        assert row["output_ids"] is None and row["prompt_ids"] is None
        assert row["provider"] == "Loopback" and row["model"] == "moonshotai/kimi-k2.5"
        assert row["finish_reason"] in ("stop", "length") and row["text"]
        assert row["completion_tokens"] >= 3 and row["reasoning"]  # the first third is reasoning, counted in
        assert row["cost_usd"] == pytest.approx(row["prompt_tokens"] * 0.6e-6 + row["completion_tokens"] * 2.5e-6)
    assert rep.reasoning_tokens == sum(r["completion_tokens"] // 3 for r in rows)


@pytest.mark.model
def test_backend_switch_mid_dataset_each_sample_once(embedded, tmp_path, serve, one_torch_thread):
    sgl = serve(SGLangApp(ModelGenerator(embedded)))
    orr = serve(OpenRouterApp(ModelGenerator(embedded), api_key=KEY))
    reqs, sampling = make_requests(6, target=embedded.name)
    store = ResponseStore(tmp_path / "r")
    budget = TokenBudget(10_000)
    first = run(reqs, SGLangBackend([sgl.url], embedded.render_prompt), store, sampling, budget, max_tokens=8,
                concurrency=3, max_new_samples=3)
    assert first.new == 3 and first.stopped_reason == "max_new_samples" and first.left_unstarted == 3
    # a new run (as after a restart) counts the budget from every source on disk
    plan = plan_remaining(reqs, store, 10_000, max_tokens=8)
    assert plan.done_by_source == {"sglang": 3} and plan.todo == 3
    budget = TokenBudget(10_000, used=plan.budget_used)
    second = run(reqs, openrouter(orr), store, sampling, budget, max_tokens=8, concurrency=3)
    assert second.already_done == 3 and second.new == 3
    rows = store.rows()
    assert sorted(ids_of(store)) == sorted(r.sample_id for r in reqs)  # the union, each exactly once
    sgl_ids = set(sgl.stats()["generated"])
    msgs = {r.sample_id: messages_key(r.messages) for r in reqs}
    or_keys = set(orr.stats()["generated"])
    assert sgl_ids == {r["sample_id"] for r in rows if r["source"] == "sglang"}
    assert or_keys == {msgs[r["sample_id"]] for r in rows if r["source"] == "openrouter"}
    assert not (or_keys & {msgs[s] for s in sgl_ids})  # nothing generated twice
    assert all(v == 1 for v in sgl.stats()["generated"].values()) and all(v == 1 for v in orr.stats()["generated"].values())
    # rerunning either backend buys nothing
    before = (sgl.stats()["requests"], orr.stats()["requests"])
    again = run(reqs, openrouter(orr), store, sampling, TokenBudget(10_000), max_tokens=8)
    again2 = run(reqs, SGLangBackend([sgl.url], embedded.render_prompt), store, sampling, TokenBudget(10_000), max_tokens=8)
    assert again.todo == again2.todo == 0 and (sgl.stats()["requests"], orr.stats()["requests"]) == before
    assert budget.used == sum(r["completion_tokens"] for r in rows)


# ---------------------------------------------------------------------------------------------
# budget, costs, stops, cancellation, crash (synthetic ids: model output is not the point)


class WatchedBudget(TokenBudget):
    """Records the most that was ever committed (used + reserved)."""

    peak = 0

    def try_reserve(self, tokens):
        ok = super().try_reserve(tokens)
        self.peak = max(self.peak, self.used + self.reserved)
        return ok

    def settle(self, reserved, actual):
        super().settle(reserved, actual)
        self.peak = max(self.peak, self.used + self.reserved)


def test_strict_budget_never_exceeded_under_faults(tmp_path, serve):
    faults = FaultPlan.from_strings("429=0.1,502=0.1,drop=0.05,finish_error=0.05,error200=0.05,heartbeat=0.1,"
                                    "402inflight=0.05,slow=0.05", seed=7, retry_after_s=0.02, slow_s=0.05, heartbeats=2)
    srv = serve(OpenRouterApp(SyntheticGenerator(), api_key=KEY, faults=faults, latency_s=0.005))
    reqs, sampling = make_requests(120)
    store = ResponseStore(tmp_path / "r")
    budget = WatchedBudget(700)
    rep = run(reqs, openrouter(srv), store, sampling, budget, max_tokens=16, concurrency=24, policy="strict")
    rows = store.rows()
    used = sum(r["completion_tokens"] for r in rows)
    assert rep.stopped_reason == "budget" and rep.left_by_budget > 0 and sum(rep.retries.values()) > 10
    assert used <= 700 and budget.peak <= 700 and budget.used == used and budget.reserved == 0
    assert 700 - used < 16  # stopped only when not one more max_tokens reservation fitted
    assert len(set(ids_of(store))) == len(rows) == rep.new
    stats = srv.stats()
    assert stats["completion_tokens_billed"] == used and math.fsum(r["cost_usd"] for r in rows) == stats["billed_usd"]
    # a later run with the budget rebuilt from disk admits nothing more
    before = stats["requests"]
    again = run(reqs, openrouter(srv), store, sampling, TokenBudget(700, used=used), max_tokens=16, policy="strict")
    assert again.new == 0 and again.stopped_reason == "budget" and srv.stats()["requests"] == before


def test_plan_remaining_across_sources(tmp_path):
    reqs, _ = make_requests(10)
    store = ResponseStore(tmp_path / "r")
    base = {k: None for k in RESPONSE_FIELDS}
    with store.writer("sglang") as w:
        w.write_batch([dict(base, sample_id=r.sample_id, source="sglang", completion_tokens=20, prompt_tokens=100)
                       for r in reqs[:2]])
    with store.writer("openrouter") as w:
        w.write_batch([dict(base, sample_id=r.sample_id, source="openrouter", completion_tokens=40, prompt_tokens=100)
                       for r in reqs[2:4]])
    plan = plan_remaining(reqs, store, 1000, max_tokens=100, prices=Prices.per_million(0.6, 2.5))
    assert plan.done == 4 and plan.todo == 6 and plan.done_by_source == {"sglang": 2, "openrouter": 2}
    assert plan.budget_used == 120 and plan.budget_remaining == 880
    assert plan.fits_worst_case == 6 and plan.expected_completion_tokens == 30 and plan.fits_expected == 6
    assert plan.cost_is_estimate and plan.projected_cost_usd == pytest.approx(6 * 100 * 0.6e-6 + 6 * 30 * 2.5e-6)
    tight = plan_remaining(reqs, store, 300, max_tokens=100)
    assert tight.fits_worst_case == 1 and tight.fits_expected == 6 and tight.projected_cost_usd is None


def test_length_finishes_are_data_and_never_bought_again(tmp_path, serve):
    srv = serve(OpenRouterApp(SyntheticGenerator(), api_key=KEY))
    reqs, sampling = make_requests(20)
    store = ResponseStore(tmp_path / "r")
    rep = run(reqs, openrouter(srv), store, sampling, max_tokens=4)
    assert rep.finish_reasons["length"] > 0 and rep.new == 20
    assert all(r["completion_tokens"] == 4 for r in store.rows() if r["finish_reason"] == "length")
    before = srv.stats()["requests"]
    assert run(reqs, openrouter(srv), store, sampling, max_tokens=64).todo == 0
    assert srv.stats()["requests"] == before


def test_failures_go_to_the_errors_file_and_stay_to_do(tmp_path, serve):
    app = OpenRouterApp(SyntheticGenerator(), api_key=KEY, faults=FaultPlan.from_strings(script="400", then="503",
                                                                                          retry_after_s=0.01))
    srv = serve(app)
    reqs, sampling = make_requests(3)
    store = ResponseStore(tmp_path / "r")
    rep = run(reqs, openrouter(srv), store, sampling, concurrency=1, retry=RetryPolicy(max_attempts=3, base_delay_s=0.01))
    errors = [json.loads(x) for x in store.errors_path.read_text().splitlines()]
    assert rep.new == 0 and rep.errors == 3 and store.rows() == []
    assert [e["reason"] for e in errors] == ["http_400", "retries_exhausted:http_503", "retries_exhausted:http_503"]
    assert [e["attempts"] for e in errors] == [1, 3, 3] and rep.retries == {"http_503": 4}
    assert {e["sample_id"] for e in errors} == {r.sample_id for r in reqs}
    app.faults = FaultPlan()  # the provider recovers: the failed samples are still to do
    assert run(reqs, openrouter(srv), store, sampling).new == 3


@pytest.mark.parametrize("fault,reason", [("401", "unauthorized"), ("402credits", "credits"), ("402keylimit", "key_limit")])
def test_401_and_credit_402_stop_the_run_cleanly(tmp_path, serve, fault, reason):
    app = OpenRouterApp(SyntheticGenerator(), api_key=KEY, latency_s=0.02,
                        faults=FaultPlan.from_strings(script="ok,ok,ok,ok,ok,ok", then=fault))
    srv = serve(app)
    reqs, sampling = make_requests(40)
    store = ResponseStore(tmp_path / "r")
    budget = TokenBudget(10**6)
    rep = run(reqs, openrouter(srv), store, sampling, budget, concurrency=3)
    assert rep.stopped_reason == reason and not rep.ok and rep.new == 6
    assert rep.left_unstarted >= 40 - 6 - 3 and srv.stats()["requests"] <= 6 + 3
    assert budget.reserved == 0 and store.path("openrouter").read_bytes().endswith(b"\n")
    assert all(json.loads(x)["reason"] == reason for x in store.errors_path.read_text().splitlines())
    with pytest.raises(RunStopped, match=reason):
        raise_for_stop(rep)
    app.faults = FaultPlan()  # key fixed / credits added: the next run finishes the rest
    rep2 = run(reqs, openrouter(srv), store, sampling)
    assert rep2.already_done == 6 and rep2.new == 34 and sorted(ids_of(store)) == sorted(r.sample_id for r in reqs)


def test_api_key_never_appears_in_logs_rows_errors_or_exceptions(tmp_path, serve, caplog, capfd):
    caplog.set_level(logging.DEBUG)  # every logger, httpx and httpcore included
    wrong = "sk-or-v1-" + secrets.token_hex(24)
    faults = FaultPlan.from_strings("429=0.15,drop=0.1,400=0.1,finish_error=0.1", seed=5, retry_after_s=0.01)
    srv = serve(OpenRouterApp(SyntheticGenerator(), api_key=KEY, faults=faults))
    reqs, sampling = make_requests(30)
    store = ResponseStore(tmp_path / "r")
    lines = []

    def progress(p):
        lines.append(p.line())
        print(p.line(), file=sys.stderr)

    good = run(reqs, openrouter(srv), store, sampling, bar=True, progress=progress, progress_every_s=0.01)
    assert good.new > 0 and good.errors > 0 and lines  # the key worked; some samples failed with 400
    # a wrong key: the loopback's 401 echoes the presented key, the client must scrub it
    bad = run(reqs, openrouter(srv, key=wrong), store, sampling, preflight=False)
    assert bad.stopped_reason == "unauthorized" and "***" in bad.fatal
    pre = run(reqs, openrouter(srv, key=wrong), store, sampling)
    assert pre.stopped_reason == "unauthorized" and pre.new == 0
    with pytest.raises(RunStopped) as exc:
        raise_for_stop(bad)
    out, err = capfd.readouterr()
    texts = {
        "logs": caplog.text, "stdout": out, "stderr": err, "exception": str(exc.value) + repr(exc.value),
        "reports": json.dumps([good.summary(), bad.summary(), pre.summary()], default=str),
        "repr": repr(openrouter(srv)) + repr(openrouter(srv, key=wrong)),
        "files": "".join(p.read_text() for p in store.dir.glob("*.jsonl")),
    }
    assert "DEBUG" in caplog.text and "unauthorized" in texts["files"]
    for where, text in texts.items():
        assert KEY not in text and wrong not in text, f"the API key leaked into {where}"


def test_cancellation_stops_admissions_and_leaves_resumable_state(tmp_path, serve):
    srv = serve(OpenRouterApp(SyntheticGenerator(), api_key=KEY, latency_s=0.2))
    reqs, sampling = make_requests(60)
    store = ResponseStore(tmp_path / "r")
    stop = threading.Event()
    stop_when_rows(store, 6, stop)
    budget = TokenBudget(10**6)
    t0 = time.monotonic()
    rep = run(reqs, openrouter(srv), store, sampling, budget, concurrency=6, stop_event=stop, drain_timeout_s=60.0)
    took = time.monotonic() - t0
    assert rep.stopped_reason == "cancelled" and 6 <= rep.new < 60
    # the drain ends when the requests in flight do, not at its 60 s bound (a margin for a slow box)
    assert took < 30
    assert rep.left_unstarted == 60 - rep.new and rep.errors == 0 and budget.reserved == 0
    stats = srv.stats()
    assert stats["ledger"]["requests"] == rep.new  # no request sent after the stop was left unfinished
    assert all(v == 1 for v in stats["generated"].values())  # in-flight requests ended and were kept
    assert store.path("openrouter").read_bytes().endswith(b"\n") and not store.errors_path.exists()
    rep2 = run(reqs, openrouter(srv), store, sampling)
    assert rep2.new == 60 - rep.new and sorted(ids_of(store)) == sorted(r.sample_id for r in reqs)
    assert all(v == 1 for v in srv.stats()["generated"].values())


def stop_when_rows(store: ResponseStore, n: int, stop: threading.Event, srv=None, requests: int = 0) -> None:
    """Set ``stop`` once ``n`` rows are on disk (and the server has seen ``requests``): an order of
    events, whatever the machine's speed."""
    def watch():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            rows = store.path("openrouter").read_bytes().count(b"\n") if store.path("openrouter").exists() else 0
            if rows >= n and (srv is None or srv.stats()["ledger"]["requests"] >= requests):
                break
            time.sleep(0.005)
        stop.set()

    threading.Thread(target=watch, daemon=True).start()


def test_cancellation_drain_is_bounded(tmp_path, serve):
    srv = serve(OpenRouterApp(SyntheticGenerator(), api_key=KEY, latency_s=0.3, faults=FaultPlan.from_strings(
        script="ok,ok,ok,ok", then="slow", slow_s=300.0)))
    reqs, sampling = make_requests(20)
    store = ResponseStore(tmp_path / "r")
    stop = threading.Event()
    stop_when_rows(store, 4, stop, srv, requests=8)  # the 4 quick replies kept, 4 slow ones in flight
    budget = TokenBudget(10**6)
    t0 = time.monotonic()
    rep = run(reqs, openrouter(srv), store, sampling, budget, concurrency=4, stop_event=stop, drain_timeout_s=0.3)
    # the slow replies take 300 s: the run ended at the drain bound instead (a margin for a slow box)
    assert time.monotonic() - t0 < 100 and rep.stopped_reason == "cancelled"
    assert rep.new == 4 and budget.reserved == 0 and len(store.rows()) == 4


def test_kill_minus_nine_mid_run_then_resume(tmp_path, serve):
    """The engine runs in a subprocess; SIGKILL lands after some rows are written; a rerun completes."""
    srv = serve(OpenRouterApp(SyntheticGenerator(), api_key=KEY, latency_s=0.05))
    n = 40
    reqs, sampling = make_requests(n)
    store = ResponseStore(tmp_path / "r")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"url": srv.url, "dir": str(store.dir), "n": n}))
    child = (
        "import asyncio, json, sys\n"
        "from tests.unit.generation.test_http_generation import make_requests, openrouter_for_url, FAST\n"
        "from eagle3_assets.generation.http_engine import run_generation\n"
        "from eagle3_assets.generation.response_store import ResponseStore\n"
        "from eagle3_assets.generation.budget import TokenBudget\n"
        "s = json.load(open(sys.argv[1]))\n"
        "reqs, sampling = make_requests(s['n'])\n"
        "asyncio.run(run_generation(reqs, openrouter_for_url(s['url']), ResponseStore(s['dir']), TokenBudget(10**9),\n"
        "    sampling=sampling, max_tokens=16, concurrency=2, retry=FAST))\n"
    )
    env = dict(os.environ, OPENROUTER_TEST_KEY=KEY)
    proc = subprocess.Popen([sys.executable, "-c", child, str(spec)], cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    out = store.path("openrouter")
    deadline = time.time() + 300
    while (not out.exists() or out.read_bytes().count(b"\n") < 8) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    written = out.read_bytes().count(b"\n")
    assert 8 <= written < n, f"the kill should land mid-run ({written} of {n}): {proc.stderr.read()[-2000:]}"
    with out.open("ab") as fh:  # what a kill during a write leaves behind
        fh.write(b'{"sample_id": "s-torn", "dataset": "ds", "text": "half a li')
    rep = run(reqs, openrouter(srv), store, sampling, max_tokens=16)
    ids = ids_of(store)
    assert rep.already_done == written and rep.new == n - written
    assert len(ids) == n and sorted(ids) == sorted(r.sample_id for r in reqs)
    assert b"s-torn" not in out.read_bytes() and out.read_bytes().endswith(b"\n")


def openrouter_for_url(url):
    """Used by the kill -9 child process."""
    return OpenRouterBackend(os.environ["OPENROUTER_TEST_KEY"], "moonshotai/kimi-k2.5", base_url=url + "/api/v1")


def test_sglang_data_parallel_base_urls_and_health_check(tmp_path, serve):
    a = serve(SGLangApp(SyntheticGenerator(), latency_s=0.01))
    b = serve(SGLangApp(SyntheticGenerator(), latency_s=0.01))
    render = SyntheticGenerator().render
    reqs, sampling = make_requests(40)
    store = ResponseStore(tmp_path / "r")
    rep = run(reqs, SGLangBackend([a.url, b.url], render), store, sampling, concurrency=20,
              client=ClientConfig(connections_per_client=5))
    assert rep.new == 40 and rep.clients == 4
    sa, sb = a.stats()["generations"], b.stats()["generations"]
    assert sa + sb == 40 and sa > 5 and sb > 5
    assert {r["provider"] for r in store.rows()} == {a.url, b.url}
    assert all(len(r["output_ids"]) == r["completion_tokens"] for r in store.rows())
    sick = serve(SGLangApp(SyntheticGenerator(), healthy=False))
    with pytest.raises(BackendUnavailable, match="health_generate"):
        run(reqs, SGLangBackend([a.url, sick.url], render), ResponseStore(tmp_path / "s"), sampling)


def test_sglang_faults_are_retried(tmp_path, serve):
    faults = FaultPlan.from_strings(script="503,finish_error,drop,500,error200", retry_after_s=0.01)
    srv = serve(SGLangApp(SyntheticGenerator(), faults=faults))
    reqs, sampling = make_requests(5)
    store = ResponseStore(tmp_path / "r")
    rep = run(reqs, SGLangBackend(srv.url, SyntheticGenerator().render), store, sampling, concurrency=1)
    assert rep.new == 5 and rep.retries == {"http_503": 1, "abort": 1, "disconnected": 1, "http_500": 1,
                                             "error_in_body": 1}
    assert [r["attempts"] for r in store.rows()][0] == 6 and rep.attempts == 10


def test_outer_cancellation_flushes_finished_rows(tmp_path, serve):
    """Ctrl-C or a Dagster interrupt cancels the coroutine itself: finished rows still reach disk."""
    srv = serve(OpenRouterApp(SyntheticGenerator(), api_key=KEY, latency_s=0.1))
    reqs, sampling = make_requests(60)
    store = ResponseStore(tmp_path / "r")
    budget = TokenBudget(10**6)

    async def main():
        task = asyncio.create_task(run_generation(reqs, openrouter(srv), store, budget, sampling=sampling,
                                                  max_tokens=16, concurrency=4, retry=FAST))
        while len(store.rows()) < 4 and not task.done():  # mid-run, whatever the machine's speed
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    written = len(store.rows())
    assert written >= 4 and store.path("openrouter").read_bytes().endswith(b"\n") and budget.reserved == 0
    rep = run(reqs, openrouter(srv), store, sampling)
    assert rep.new == 60 - written and sorted(ids_of(store)) == sorted(r.sample_id for r in reqs)


def test_unreachable_backend_stops_the_run(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    reqs, sampling = make_requests(10)
    store = ResponseStore(tmp_path / "r")
    be = OpenRouterBackend(KEY, "m/x", base_url=f"http://127.0.0.1:{port}/api/v1")
    rep = run(reqs, be, store, sampling, preflight=False, concurrency=2,
              retry=RetryPolicy(max_attempts=50, base_delay_s=0.01, max_delay_s=0.02, unreachable_after=6))
    assert rep.stopped_reason == "unreachable" and rep.new == 0 and rep.retries["connect_error"] >= 4
    assert rep.left_unstarted + rep.abandoned + rep.errors == 10
    with pytest.raises(BackendUnavailable):
        run(reqs, SGLangBackend(f"http://127.0.0.1:{port}", lambda m: [1]), store, sampling)
