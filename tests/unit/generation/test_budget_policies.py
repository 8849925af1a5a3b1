"""Both budget policies on heavy-tailed reply lengths, against the loopback OpenRouter server.

Lengths are log-normal (median 20 tokens, sigma 1.2: mean ~41, one reply in ~170 longer than 300)
and cut at ``max_tokens`` 300, ten times the mean as with thinking replies; each reply takes
0.2-0.3 s plus 0.3 ms per token, so long replies take longer. The budget is ~35 waves of the gate,
so the run is long against its end. At the real scale (10M tokens, 2,000 in flight, mean ~3,300,
``max_tokens`` 32k) the budget is under two waves: there ``strict`` caps the gate at ~300 from
the first second, which is what the default policy removes.
"""

import asyncio

import pytest

from eagle3_assets.engines.http.samples import SampleRequest, SamplingSettings
from eagle3_assets.engines.openrouter.backend import OpenRouterBackend
from eagle3_assets.generation.budget import TokenBudget
from eagle3_assets.generation.http_engine import RetryPolicy, run_generation
from eagle3_assets.generation.response_store import ResponseStore
from eagle3_assets.loopback import OpenRouterApp, SyntheticGenerator, serve_in_thread

KEY = "sk-or-v1-budget-test"
LIMIT, MAX_TOKENS = 20, 300
SERVER_FULL_GATE_FLOOR = 0.65  # share of the run the server saw 95% of the gate in flight (expected policy)


@pytest.fixture
def heavy_tailed():
    app = OpenRouterApp(SyntheticGenerator(lengths="lognormal", median=20, sigma=1.2), api_key=KEY,
                        latency_s=0.2, latency_jitter_s=0.1, latency_per_token_s=0.0003, seed=1)
    srv = serve_in_thread(app)
    yield srv
    srv.stop()


def generate(srv, tmp_path, policy: str, budget: int, n: int = 3000):
    reqs = [SampleRequest(f"s{policy}{i:06d}", "heavy", f"p{i}", 0,
                          [{"role": "user", "content": f"heavy: question {i}"}]) for i in range(n)]
    store = ResponseStore(tmp_path / policy)
    lines = []
    rep = asyncio.run(run_generation(
        reqs, OpenRouterBackend(KEY, "m", base_url=srv.url + "/api/v1"), store, TokenBudget(budget),
        sampling=SamplingSettings("t"), max_tokens=MAX_TOKENS, concurrency=LIMIT, policy=policy,
        retry=RetryPolicy(seed=0), progress=lambda p: lines.append(p.line()), progress_every_s=5.0))
    # the server's own record, from its first request to its last reply (the drain included): the
    # share of that time with 95% of the gate in progress there and the mean in progress; next to the
    # engine's meter (samples held in the gate, while admitting)
    server = {"share": srv.call(srv.app.full_share, LIMIT), "mean": srv.stats()["concurrency_mean"] / LIMIT}
    print(f"{policy}: gate full {server['share']:.1%} of the run by the server's record (mean in flight "
          f"{server['mean']:.1%} of the gate), {rep.full_gate_share:.1%} by the engine's meter")
    return rep, sum(r["completion_tokens"] for r in store.rows()), lines, server


def test_expected_policy_keeps_the_gate_full_and_ends_within_one_percent(heavy_tailed, tmp_path):
    budget = 40_000
    rep, used, lines, server_share = generate(heavy_tailed, tmp_path, "expected", budget)
    assert rep.stopped_reason == "budget" and rep.left_by_budget > 0
    assert abs(used - budget) <= 0.01 * budget, f"{used} tokens for a budget of {budget}"
    assert rep.budget_used == used and rep.budget_overshoot == max(0, used - budget)
    assert rep.full_gate_share >= 0.9, f"the gate was full {rep.full_gate_share:.1%} of the run"
    # by the server's record the gate dips while a worker turns a reply into its next request (a few ms,
    # a larger share of a 0.3 s reply than of a real one) and drains at the end; its mean stays near full.
    # The bound on the full-gate share is the server's, not the engine's meter: three runs on the shared
    # 2-core box (load 2-6) measured 82.2%, 70.8% and 88.2% (the README's 81.5-85.3% was a quieter box);
    # the strict policy, which does not hold the gate, 13.8%. A worker that idles 30 ms between a reply
    # and its next request kept the engine's meter at 95.6% and the server's mean at 85.8% (both passed)
    # but the server's full-gate share fell to 32.7%: this bound is what catches it.
    assert server_share["share"] >= SERVER_FULL_GATE_FLOOR, server_share
    assert server_share["mean"] >= 0.85, server_share
    # after the stop the last progress line says what happened instead of projecting
    assert "the token budget is spent" in lines[-1] and "ETA" not in lines[-1] and "est." not in lines[-1]


def test_strict_policy_never_exceeds_and_pays_for_it_in_concurrency(heavy_tailed, tmp_path):
    budget = 8_000
    rep, used, _, server_share = generate(heavy_tailed, tmp_path, "strict", budget)
    assert rep.stopped_reason == "budget" and used <= budget and budget - used < MAX_TOKENS
    # every request holds max_tokens: at most budget / 300 = 26 fit, then fewer and fewer
    assert rep.full_gate_share < 0.6 and rep.budget_overshoot == 0
    assert server_share["share"] < 0.6 and server_share["mean"] < 0.8  # the server saw the same
