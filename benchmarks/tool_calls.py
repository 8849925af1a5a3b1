"""Agentic data at scale on kimi-mini: the prompts pass on glaive rows, and tool-call reconstruction.

1. A synthetic glaive-function-calling file (``system`` with one to three JSON function
   definitions, ``chat`` ending at a user turn or after a function response) goes through the
   whole ``prompts`` pass (read, parse calls, render with the TypeScript tool declaration, measure,
   write); yardstick: the same parsed conversations rendered by the bare
   ``apply_chat_template(messages, tools=...)`` loop, nothing else around it.
2. kimi-mini answers the prompts (batched greedy generation) and the loopback's tool-call writer
   turns the answers to user turns into Kimi tool calls, as the SGLang loopback serves them: native
   ids whose string arguments are ids the model generated. Each row is then rebuilt the way a
   text-only row (OpenRouter) is, from its parsed calls through the chat template, and compared
   with its ids: the tool-call reconstruction agreement on native rows. Also printed: token rows/s
   for tool-call rows and for text rows (a tool-call row renders its conversation once more).

Run: `.venv/bin/python benchmarks/tool_calls.py [--rows 2000] [--answers 200]`.
"""

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results import record  # noqa: E402

CITIES = "Oslo Lima Rome Quito Bern Graz Lyon Kyiv Pune Cusco".split()
FUNCTIONS = [
    {"name": "get_weather", "description": "Current weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                                                     "days": {"type": "integer", "minimum": 1}}, "required": ["city"]}},
    {"name": "convert_currency", "description": "Convert an amount between currencies",
     "parameters": {"type": "object", "properties": {"amount": {"type": "number"},
                                                     "to": {"type": "string", "enum": ["EUR", "USD", "JPY"]}},
                    "required": ["amount", "to"]}},
    {"name": "search_news", "description": "Search recent news\nReturns headlines",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                     "tags": {"type": "array", "items": {"type": "string"}}},
                    "required": ["query"]}},
]


def glaive_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        fns = rng.sample(FUNCTIONS, rng.randint(1, 3))
        system = ("SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -\n"
                  + "\n\n".join(json.dumps(f, indent=4) for f in fns))
        city = rng.choice(CITIES)
        chat = f"USER: What is the weather like in {city} this week? (ticket {i})"  # every conversation its own
        if rng.random() < 0.5:
            chat += (f"\n\n\nASSISTANT: <functioncall> {{\"name\": \"{fns[0]['name']}\", \"arguments\": "
                     f"'{{\"city\": \"{city}\"}}'}} <|endoftext|>\n\n\nFUNCTION RESPONSE: {{\"sky\": \"clear\"}}\n\n\n"
                     "ASSISTANT: It is clear. <|endoftext|>\n\n\nUSER: And tomorrow?")
        rows.append({"system": system, "chat": chat})
    return rows


def prompts_pass(tok, path: Path, out: Path) -> tuple[float, float, int]:
    from eagle3_assets.prompts.build import build_prompt_table
    from eagle3_assets.prompts.context import ContextLimit
    from eagle3_assets.prompts.reader import PromptReader, read_prompt_file

    t0 = time.perf_counter()
    report = build_prompt_table(PromptReader(path), tok, ContextLimit(tok.context_length, 256), "refuse", out)
    whole = time.perf_counter() - t0
    parsed = read_prompt_file(path).prompts
    t0 = time.perf_counter()
    for p in parsed:
        tok.tokenizer.apply_chat_template(p.messages, tools=p.tools, tokenize=True, add_generation_prompt=True)
    bare = time.perf_counter() - t0
    return whole, bare, report.written


def reconstruction(tok, model, prompts, batch: int = 16, malform: str | None = None) -> dict:
    from eagle3_assets.engines.http.samples import SampleRequest
    from eagle3_assets.loopback.tool_replies import ToolCaller
    from eagle3_assets.target.tool_calls import KimiFormat
    from eagle3_assets.tokens.rows import build_token_row

    caller, rows = ToolCaller(tok, malform), []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        ids = [SampleRequest(p.prompt_id, "bench", p.prompt_id, 0, p.messages, p.tools).render(tok.render_prompt)
               for p in chunk]
        for p, prompt_ids, gen in zip(chunk, ids, model.generate(ids, max_new_tokens=48)):
            reply = caller.reply(prompt_ids, gen.output_ids)
            out = reply.output_ids if reply else gen.output_ids
            rows.append((p, {"sample_id": p.prompt_id, "dataset": "bench", "prompt_id": p.prompt_id, "source": "sglang",
                             "prompt_ids": prompt_ids, "output_ids": out, "text": tok.decode(out[:-1]),
                             "reasoning": None, "tool_calls": None,
                             "finish_reason": "stop" if reply or gen.finish_reason == "stop" else "length"}))
    figures = {}
    for kind in ("tool", "text"):
        t0, matched, total, exact, n, leftovers, parsed = time.perf_counter(), 0, 0, 0, 0, 0, 0
        for p, r in rows:
            if (r["output_ids"].count(163595) > 0) != (kind == "tool"):
                continue
            t = build_token_row(r, p.messages, tok, tools=p.tools)
            matched, total, exact, n = matched + t["retok_matched"], total + t["retok_total"], exact + t["retok_exact"], n + 1
            if kind == "tool":  # what the parser made of the section: calls found, ids outside any call
                _, calls, left = KimiFormat.of(tok).split_counted(tok, r["output_ids"])
                parsed, leftovers = parsed + bool(calls), leftovers + left
        seconds = time.perf_counter() - t0
        figures[kind] = {"rows": n, "agreement": matched / total if total else None, "exact": exact / n if n else None,
                         "rows_per_s": n / seconds if seconds else 0.0, "tokens": total,
                         "rows_parsed": parsed, "leftover_ids": leftovers}
    return figures


def kimi_mini_target():
    """kimi-mini's model folder (built once into the data root's model cache) and its tokenizer, with
    torch on both cores."""
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.target.embedded import set_threads
    from eagle3_assets.target.kimi_mini import ensure_kimi_mini
    from eagle3_assets.target.tokenizer import TargetTokenizer

    set_threads(2)
    kimi = ensure_kimi_mini(DataLayout.from_env().models_dir)
    return kimi, TargetTokenizer.load(kimi, trust_remote_code=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--answers", type=int, default=200)
    args = ap.parse_args()
    from eagle3_assets.prompts.table import read_prompt_table
    from eagle3_assets.target.embedded import EmbeddedModel

    kimi, tok = kimi_mini_target()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "b1_glaive.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in glaive_rows(args.rows)))
        whole, bare, written = prompts_pass(tok, path, Path(tmp) / "table.parquet")
        print(f"prompts pass, {written:,} glaive rows with tools: {written / whole:,.0f} rows/s "
              f"(bare apply_chat_template(tools=...) loop: {written / bare:,.0f} rows/s; ratio {whole / bare:.2f}x)")
        prompts = read_prompt_table(Path(tmp) / "table.parquet")[:args.answers]
    passes = {"rows": written, "rows_per_s": written / whole, "bare_rows_per_s": written / bare, "ratio": whole / bare}
    model = EmbeddedModel(kimi, tokenizer=tok)
    rebuilt = reconstruction(tok, model, prompts)
    for kind, f in rebuilt.items():
        agree = "n/a" if f["agreement"] is None else f"{f['agreement']:.4%}"
        exact = "n/a" if f["exact"] is None else f"{f['exact']:.1%}"
        print(f"{kind} replies with native ids: {f['rows']} rows, {f['tokens']:,} tokens: re-rendering agrees on "
              f"{agree} of tokens, {exact} exact; token rows {f['rows_per_s']:,.0f}/s")
    record("tool_calls", {"prompts_pass": passes, "reconstruction": rebuilt})


if __name__ == "__main__":
    main()
