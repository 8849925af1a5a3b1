"""A serve role without a server, for the serving stage's tests: deterministic outputs and counters.

Each prompt's output is a function of its ids (the same for every setting, as greedy decoding must
be), except where ``corrupt`` names a (steps, prompt length) pair; a setting of ``steps`` accepts
``steps - 1`` drafts per verification step. ``die_after`` kills the "server" after that many timed
requests once; ``started`` counts server starts.
"""

from __future__ import annotations

import time

from eagle3_assets.engines.stream import Streamed


class FakeServer:
    def __init__(self, role, drafter_dir, k):
        self.role, self.drafter_dir, self.k = role, drafter_dir, k

    def __enter__(self):
        self.role.started.append(self.k if self.drafter_dir else 0)
        return self

    def __exit__(self, *exc):
        return None

    def command(self) -> list[str]:
        return ["fake-serve", "--drafter", str(self.drafter_dir or ""), "--steps", str(self.k)]


class FakeServe:
    takes_trees = False

    def __init__(self):
        self.started: list[int] = []
        self.die_after: int | None = None
        self.requests = 0
        self.corrupt: set[tuple[int, int]] = set()
        self.missing_reason: str | None = None
        self.problem_reason: str | None = None
        self.current_k = 0

    def server(self, model_dir, drafter_dir, *, k, python="", topk=1, draft_tokens=0):
        self.current_k = k if drafter_dir else 0
        return FakeServer(self, drafter_dir, k)

    def url(self, server) -> str:
        return f"fake://k{server.k if server.drafter_dir else 0}"

    def missing(self, python=""):
        return self.missing_reason

    def version(self, python=""):
        return "fake 1.0"

    def problem(self, model_dir, drafter_dir, python=""):
        return self.problem_reason

    def timed(self, client, url, ids, *, max_new_tokens, stop_token_ids=(), model=""):
        self.requests += 1
        if self.die_after is not None and self.requests > self.die_after:
            self.die_after = None
            raise ConnectionError("the fake server died")
        k = int(url.rsplit("k", 1)[1])
        out = [(sum(ids) + i) % 97 for i in range(min(max_new_tokens, 6))]
        if (k, len(ids)) in self.corrupt:
            out[2] += 1
        t = time.perf_counter()
        steps = len(out) if k == 0 else -(-len(out) // k)
        return Streamed(sent=t - 0.01, arrivals=[t + i * 0.001 for i in range(len(out))], output_ids=out,
                        meta={"steps": steps, "accepted": len(out) - steps})

    def counters(self, client, url) -> dict:
        return {}

    def batch_acceptance(self, before, after, replies, steps):
        drafts = sum(r.meta["steps"] for r in replies)
        accepted = sum(r.meta["accepted"] for r in replies)
        return {"drafts": drafts, "draft_tokens": steps * drafts, "accepted_tokens": accepted,
                "acceptance_length": 1 + accepted / drafts, "acceptance_length_no_bonus": accepted / drafts,
                "per_position_rate": []}

    def user_command(self, model_dir, drafter_dir, *, k, topk=1, draft_tokens=0) -> str:
        return f"fake-serve {model_dir} --drafter {drafter_dir} --steps {k}"


SERVE = FakeServe()
