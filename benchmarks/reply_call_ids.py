"""Reply tool-call ids on a replayed agent-trace file: does every reply's call get K2.5's id?

K2.5 numbers a call ``functions.<name>:<n>``, ``n`` counting the conversation's calls from 0.
Providers write other ids, and their index restarts each turn. This replays a trace file the way an
OpenRouter-protocol provider answers it (text and structured ``tool_calls``, no ids) with the
reply's call ids in each form providers use (``functions.NAME:i``, ``NAME:i``, ``call_...``, ``i``
restarting at 0 in each reply), builds each token row, decodes the training sequence and parses the
ids back out of the text: a reply is numbered right when its calls' ids are ``:<h>``, ``:<h+1>``, ...
with ``h`` the ``<|tool_call_begin|>`` markers counted in the decoded prompt, and no id of the whole
sequence repeats. The figures do not come from a count the code under test computed.

Two kinds of replies are replayed, both from the file: the recorded assistant turns with calls
(after tool results, i.e. after history calls) and, for each prompt that ends on a user turn, the
loopback tool-reply writer's reply (:class:`~eagle3_assets.loopback.tool_replies.ToolCaller`),
the calls as a provider's parser reports them. Figures go to ``benchmarks/results/reply_call_ids.json``.

Run: `.venv/bin/python benchmarks/reply_call_ids.py [--traces 200]`.
"""

import argparse
import json
import os
import random
import re
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FORMS = {
    "functions.NAME:i": lambda name, k, tag: f"functions.{name}:{k}",
    "NAME:i": lambda name, k, tag: f"{name}:{k}",
    "call_...": lambda name, k, tag: f"call_{tag}{k}",
}
CALL_ID = re.compile(r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>", re.S)


def traces(n: int, seed: int = 3) -> list[dict]:
    """Multi-turn agent traces: each user turn answered by one or two calls, their results and a
    text answer; some user turns follow earlier calls, so replies come after history calls."""
    from benchmarks.agentic import FUNCTIONS

    rng, rows = random.Random(seed), []
    tools = [{"type": "function", "function": f} for f in FUNCTIONS[1:]]
    for i in range(n):
        msgs, k = [{"role": "system", "content": "You are a careful agent."}], 0
        for turn in range(rng.randint(1, 3)):
            msgs.append({"role": "user", "content": f"Weather in Oslo, then convert {i + turn} USD."})
            for _step in range(rng.randint(1, 2)):
                calls = [{"id": f"call_{i}_{k + j}", "type": "function", "function": {
                    "name": rng.choice(["get_weather", "convert_currency"]), "arguments": json.dumps({"city": "Oslo"})}}
                    for j in range(2 if rng.random() < 0.3 else 1)]
                k += len(calls)
                msgs.append({"role": "assistant", "content": None, "tool_calls": calls, "reasoning_content": "Look it up."})
                msgs += [{"role": "tool", "tool_call_id": c["id"], "content": "{\"ok\": true}"} for c in calls]
            msgs.append({"role": "assistant", "content": "Done.", "reasoning_content": "All in."})
        rows.append({"id": f"trace-{i}", "tools": tools, "messages": msgs})
    return rows


def replies(tok, path: Path):
    """(prompt, provider calls) for every reply replayed from the file."""
    from eagle3_assets.loopback.tool_replies import ToolCaller
    from eagle3_assets.prompts.build import build_prompt_table
    from eagle3_assets.prompts.context import ContextLimit
    from eagle3_assets.prompts.options import ReadOptions
    from eagle3_assets.prompts.reader import PromptReader
    from eagle3_assets.prompts.table import read_prompt_table
    from eagle3_assets.prompts.turns import conversation_id

    table = path.with_suffix(".parquet")
    build_prompt_table(PromptReader(path, ReadOptions(prompt_per_assistant_turn=True)), tok, ContextLimit(32768, 256),
                       "refuse", table)
    recorded = {}  # the trace's own call turns, by the history length that precedes them
    for row in map(json.loads, path.read_text().splitlines()):
        for j, m in enumerate(row["messages"]):
            if m["role"] == "assistant" and m.get("tool_calls"):
                recorded[(row["id"], j)] = [c["function"] for c in m["tool_calls"]]
    caller = ToolCaller(tok)
    for p in read_prompt_table(table):
        conv = conversation_id(p.prompt_id)
        calls = recorded.get((conv, len(p.messages)))
        if calls:
            yield "recorded", p, calls
        if p.messages[-1]["role"] == "user":
            ids = tok.render_prompt(p.messages, p.tools)
            made = caller.reply(ids, tok.encode_text("Oslo is cold today and Lima warm") + [tok.end_of_turn_id])
            if made is not None:
                yield "loopback writer", p, [c["function"] for c in made.tool_calls]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", type=int, default=200)
    args = ap.parse_args()
    from benchmarks.results import record
    from eagle3_assets.target.tokenizer import TargetTokenizer
    from eagle3_assets.tokens.rows import build_token_row
    from tests.support.kimi_tokenizer import build_kimi_test_tokenizer

    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        tok = TargetTokenizer.load(build_kimi_test_tokenizer(Path(tmp) / "kimi"), trust_remote_code=True)
        path = Path(tmp) / "traces.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in traces(args.traces)))
        cases = list(replies(tok, path))
        for form, make in FORMS.items():
            right = after_history = right_after = 0
            by_kind = {}
            for n, (kind, p, calls) in enumerate(cases):
                provider = [{"id": make(c["name"], k, f"{n:x}"), "type": "function", "function": c}
                            for k, c in enumerate(calls)]
                row = {"sample_id": f"s{n}", "dataset": "replay", "prompt_id": p.prompt_id, "source": "openrouter",
                       "prompt_ids": None, "output_ids": None, "text": "", "reasoning": "Look it up.",
                       "tool_calls": provider, "finish_reason": "stop"}
                t = build_token_row(row, p.messages, tok, tools=p.tools)
                prompt_text = tok.decode(t["input_ids"][:t["prompt_len"]])
                seq = CALL_ID.findall(tok.decode(t["input_ids"]))
                h = prompt_text.count("<|tool_call_begin|>")
                got = seq[h:]
                want = [f"functions.{c['name']}:{h + k}" for k, c in enumerate(calls)]
                ok = got == want and len(set(seq)) == len(seq)
                right += ok
                after_history += h > 0
                right_after += ok and h > 0
                k_right, k_all = by_kind.get(kind, (0, 0))
                by_kind[kind] = (k_right + ok, k_all + 1)
            figures[form] = {"replies": len(cases), "numbered_right": right, "after_history_calls": after_history,
                             "numbered_right_after_history": right_after,
                             **{f"{k}_numbered_right": v[0] for k, v in by_kind.items()},
                             **{f"{k}_replies": v[1] for k, v in by_kind.items()}}
            print(f"{form:18s}: {right}/{len(cases)} replies numbered right ({right_after}/{after_history} of those "
                  "after history calls; " + ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in by_kind.items()) + ")")
    record("reply_call_ids", figures)


if __name__ == "__main__":
    main()
