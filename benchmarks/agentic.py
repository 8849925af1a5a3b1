"""Agentic datasets on kimi-mini: what the reader keeps, how many prompts each mode makes, what
history reasoning costs in prompt tokens, and how the target's own replies come out.

Two files are written here, in the real forms (no hub download):

- a glaive-function-calling-v2 style file (``system`` + ``chat`` with ``USER:``/``ASSISTANT:``/
  ``FUNCTION RESPONSE:`` markers and ``<functioncall>`` JSON): one to three functions or none,
  single-quoted arguments with ``\\'`` apostrophes and nested JSON, text after a call, turns with two
  calls, multi-turn chats, and about 1% of rows broken the way scraped dumps are (cut-off JSON);
- an OpenAI-style agent-trace file: tool-call turns with ``reasoning_content`` (one in four with
  two parallel calls), results, a final answer.

Each is read with ``final_assistant: drop`` (one prompt per conversation) and with
``prompt_per_assistant_turn``; the figures printed: rows accepted/refused by reason, prompts per
conversation, prompt tokens with and without the history reasoning, and, on a sample answered by
kimi-mini through the loopback's tool-call writer (the SGLang loopback's replies), the share of
replies that are tool calls and the re-rendering agreement on those native-id rows; then the same
sample with the loopback's sections broken each way servers break them (whitespace between the
markers, no section end, stray words inside the section, text after it): the rows the parser still
reads calls from, the ids it leaves outside any call, and the agreement on those rows. The figures
go to ``benchmarks/results/agentic.json``.

Run: `.venv/bin/python benchmarks/agentic.py [--rows 2000] [--traces 300] [--answers 48]`.
"""

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FUNCTIONS = [
    {"name": "send_note", "description": "Send a note to a contact",
     "parameters": {"type": "object", "properties": {"to": {"type": "string"}, "text": {"type": "string"},
                                                     "meta": {"type": "object", "properties": {
                                                         "tags": {"type": "array", "items": {"type": "string"}}}}},
                    "required": ["to", "text"]}},
    {"name": "get_weather", "description": "Current weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"name": "convert_currency", "description": "Convert an amount",
     "parameters": {"type": "object", "properties": {"amount": {"type": "number"}, "to": {"type": "string"}},
                    "required": ["amount", "to"]}},
]
NAMES = "Ann Bo Chidi Dana Eun Femi".split()
NO_FUNCTIONS = "SYSTEM: You are a helpful assistant, with no access to external functions."


def _glaive_call(rng, fn: dict, k: int) -> str:
    if fn["name"] == "send_note":
        to, hour = rng.choice(NAMES), rng.randint(1, 12)
        args = ('{"to": "' + to + '", "text": "It\\\'s done, see you at ' + str(hour) + ' o\\\'clock", '
                '"meta": {"tags": ["work", "t' + str(k) + '"]}}')
    elif fn["name"] == "get_weather":
        city = rng.choice(["Oslo", "Lima", "Xi'an"]).replace("'", "\\'")
        args = '{"city": "' + city + '"}'
    else:
        args = '{"amount": ' + str(rng.randint(1, 900)) + ', "to": "EUR"}'
    return f"<functioncall> {{\"name\": \"{fn['name']}\", \"arguments\": '{args}'}}"


def glaive_rows(n: int, seed: int = 0) -> list[dict]:
    rng, rows = random.Random(seed), []
    for i in range(n):
        if rng.random() < 0.15:
            rows.append({"system": NO_FUNCTIONS, "chat": f"USER: Tell me a joke about {i}\n\n\n"
                                                          "ASSISTANT: Why did the number cross the road? <|endoftext|>"})
            continue
        fns = rng.sample(FUNCTIONS, rng.randint(1, 3))
        system = ("SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -\n"
                  + "\n\n".join(json.dumps(f, indent=4) for f in fns))
        chat = [f"USER: Please help with request {i}, it's urgent."]
        for turn in range(rng.choice([1, 1, 2])):
            calls = [_glaive_call(rng, fns[0], i)] + ([_glaive_call(rng, fns[-1], i)] if rng.random() < 0.08 else [])
            after = " I have asked for that." if rng.random() < 0.1 else ""
            chat.append("ASSISTANT: " + " ".join(calls) + after + " <|endoftext|>")
            chat += ['FUNCTION RESPONSE: {"status": "ok", "detail": {"id": ' + str(turn) + '}}'] * len(calls)
            chat.append("ASSISTANT: Done, it's taken care of. <|endoftext|>")
            chat.append("USER: Thanks! One more thing.")
        text = "\n\n\n".join(chat[:-1])
        if rng.random() < 0.01:  # a scraped row cut off inside its call
            text = text[:text.find("<functioncall>") + 40]
        rows.append({"system": system, "chat": text})
    return rows


def trace_rows(n: int, seed: int = 1) -> list[dict]:
    rng, rows = random.Random(seed), []
    tools = [{"type": "function", "function": f} for f in FUNCTIONS]
    for i in range(n):
        msgs, k = [{"role": "system", "content": "You are a careful agent."},
                   {"role": "user", "content": f"Weather in Oslo and Lima, then convert {i} USD, then tell Ann."}], 0
        for step in range(rng.randint(1, 3)):
            width = 2 if rng.random() < 0.25 else 1
            calls = [{"id": f"call_{i}_{k + j}", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": rng.choice(["Oslo", "Lima"])})}}
                for j in range(width)]
            k += width
            msgs.append({"role": "assistant", "content": None, "tool_calls": calls,
                         "reasoning_content": f"Step {step}: I need the weather for {width} place(s) before I can "
                                              "answer, so I call the tool and wait for its result."})
            msgs += [{"role": "tool", "tool_call_id": c["id"], "content": json.dumps({"sky": "clear", "t": 12})}
                     for c in calls]
        msgs.append({"role": "assistant", "content": "Both are clear; 12 degrees.", "reasoning_content": "All in."})
        rows.append({"id": f"trace-{i}", "tools": tools, "messages": msgs})
    return rows


def read(path: Path, per_turn: bool):
    from eagle3_assets.prompts.options import ReadOptions
    from eagle3_assets.prompts.reader import PromptReader

    opts = ReadOptions(prompt_per_assistant_turn=True) if per_turn else ReadOptions(final_assistant="drop")
    reader = PromptReader(path, opts, skip_invalid=True)
    prompts = list(reader)
    return reader, prompts


def prompt_tokens(tok, prompts, keep_reasoning: bool) -> int:
    total = 0
    for p in prompts:
        msgs = p.messages if keep_reasoning else [{k: v for k, v in m.items() if k != "reasoning_content"}
                                                  for m in p.messages]
        total += len(tok.render_prompt(msgs, tools=p.tools))
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--traces", type=int, default=300)
    ap.add_argument("--answers", type=int, default=48)
    args = ap.parse_args()
    from benchmarks.results import record
    from benchmarks.tool_calls import kimi_mini_target, reconstruction
    from eagle3_assets.loopback.tool_replies import MALFORMED
    from eagle3_assets.target.embedded import EmbeddedModel

    kimi, tok = kimi_mini_target()
    model = EmbeddedModel(kimi, tokenizer=tok)
    rng = random.Random(7)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        files = {"glaive": (Path(tmp) / "glaive.jsonl", glaive_rows(args.rows)),
                 "agent traces": (Path(tmp) / "traces.jsonl", trace_rows(args.traces))}
        for name, (path, rows) in files.items():
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            for per_turn in (False, True):
                mode = "prompt per assistant turn" if per_turn else "final assistant dropped"
                reader, prompts = read(path, per_turn)
                refused = ", ".join(f"{k}: {v}" for k, v in reader.log.counts.most_common()) or "none"
                ends = sum(p.messages[-1]["role"] == "tool" for p in prompts)
                key = f"{'glaive' if name == 'glaive' else 'traces'}_{'per_turn' if per_turn else 'one'}"
                results[key] = {"conversations": reader.conversations, "refused": reader.skipped,
                                "prompts": len(prompts), "per_conversation": round(len(prompts) / reader.conversations, 2)}
                print(f"{name} ({len(rows):,} rows), {mode}: {reader.conversations:,} conversations accepted, "
                      f"{reader.skipped:,} refused ({refused}); {len(prompts):,} prompts, "
                      f"{len(prompts) / reader.conversations:.2f} per conversation; "
                      f"{ends / len(prompts):.1%} end at a tool result")
                if name == "agent traces":
                    with_r, without = prompt_tokens(tok, prompts, True), prompt_tokens(tok, prompts, False)
                    results[key].update(tokens_with_reasoning=with_r, tokens_without=without)
                    print(f"  prompt tokens: {with_r:,} with history reasoning, {without:,} without "
                          f"(+{with_r / without - 1:.1%})")
                sample = rng.sample(prompts, min(args.answers, len(prompts)))
                figures = reconstruction(tok, model, sample)
                calls = figures["tool"]["rows"]
                agree = figures["tool"]["agreement"]
                print(f"  {len(sample)} sampled prompts answered by kimi-mini + loopback tool-call writer: "
                      f"{calls} tool-call replies ({calls / len(sample):.1%}); re-rendering agreement on their native "
                      f"ids: {'n/a' if agree is None else f'{agree:.4%}'}, exact rows "
                      f"{'n/a' if figures['tool']['exact'] is None else format(figures['tool']['exact'], '.1%')}")
                results[key].update(sampled=len(sample), tool_call_replies=calls,
                                    agreement=None if agree is None else round(agree, 4))
                if key == "traces_per_turn":  # the mode with the most call points: break its sections
                    results["malformed"] = {"well_formed": _section_figures(figures)}
                    for kind, how in MALFORMED.items():
                        broken = _section_figures(reconstruction(tok, model, sample, malform=kind))
                        results["malformed"][kind] = broken
                        print(f"  sections broken ({how}): {broken['rows']} tool-call replies, calls read from "
                              f"{broken['rows_parsed']}, {broken['leftover_ids']} ids outside any call, agreement "
                              f"{broken['agreement']:.2%}")
    record("agentic", results)


def _section_figures(figures: dict) -> dict:
    tool = figures["tool"]
    return {"rows": tool["rows"], "rows_parsed": tool["rows_parsed"], "leftover_ids": tool["leftover_ids"],
            "agreement": None if tool["agreement"] is None else round(tool["agreement"], 4)}


if __name__ == "__main__":
    main()
