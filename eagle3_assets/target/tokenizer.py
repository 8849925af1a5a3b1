"""The target's tokenizer: its chat rendering, its special tokens and its re-tokenization of text.

Every stage that renders a prompt or reads ids asks this one wrapper (prompts for context
lengths, generation for local ids, tokens for training sequences, the engines for their checks).
The re-tokenization used to calibrate rows with ids is the very function the token rows use to
build rows without ids (``TargetTokenizer.retokenize_completion``, :mod:`eagle3_assets.tokens.rows`).

Re-tokenization contract (how Kimi-K2.5 and SGLang treat special tokens and thinking):
- the prompt is rendered with the chat template as the server does: ``tokenize=True`` and
  ``add_generation_prompt=True`` passed explicitly (Kimi's tokenizer overrides the defaults), the
  ``thinking`` template kwarg passed only when configured. Literal special-token strings in
  *prompt* messages (a user typing ``<|im_end|>``) become special ids, exactly as the server's own
  rendering tokenizes them, because those are the ids the target was conditioned on;
- the completion is tokenized as the target's own tokenizer encodes text: Kimi's ``encode``
  allows every special string (``split_special_tokens`` has no effect on it), so a literal
  ``<|im_end|>`` in API text becomes id 163586; every tokenizer is asked the same way, so the
  result never depends on a keyword only some tokenizers honour. Such rows are flagged in
  ``build_notes`` and counted in ``literal_specials`` for ``special_tokens_valid`` to report.
  Non-special added tokens (Kimi's ``<think>``, ``</think>`` and tool-call markers) map to their
  ids, as Kimi's own encode does;
- reasoning is placed where the template's generating turn puts it: when the prompt ends with
  ``<think>`` (K2.5 thinking generation prompt) the completion is ``reasoning </think> text``.
  Rows whose text is the server's decode of its own ids (SGLang, local) carry the reasoning
  *inside* ``text`` (``reasoning</think>answer``, reasoning None): it is split at the first
  ``</think>``, and a think block the ids never closed is kept open (``split_thinking``);
  when the template has think tokens but the prompt does not open one and the row carries
  reasoning, the model emitted the whole block: ``<think> reasoning </think> text``; a
  tokenizer without think tokens gets ``text`` only. A completion that stopped gets the
  end-of-turn id (looked up by string) appended.
- multi-turn prompts: only the final, generated assistant turn is supervised (the loss mask
  covers the completion only). History turns are whatever the template renders for them (Kimi
  K2.5: ``<think></think>{content}``, reasoning dropped), because the prompt ids are the template's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_assets.target.tool_calls import KimiFormat, template_renders_tools
from eagle3_assets.target.vocab import SpecialTokenError, lookup_token_id, optional_token_id

THINK_START = "<think>"
THINK_END = "</think>"
_SANE_MAX = 10_000_000  # tokenizers report 1e30 for "no limit"


@dataclass
class TargetTokenizer:
    """The target's tokenizer plus the facts the checks rely on.

    ``thinking``: None leaves the chat template's default; True/False is passed to the template as
    the ``thinking`` kwarg (Kimi K2.5's switch between ``<think>`` and ``<think></think>``).
    ``end_of_turn`` defaults to the token the chat template closes an assistant turn with (Kimi:
    ``<|im_end|>`` 163586, not its ``eos_token`` ``[EOS]`` 163585), else ``eos_token``.
    ``context_length``: the model's context from its ``config.json`` (``max_position_embeddings``)
    or a sane ``model_max_length``; None when unknown.
    """

    tokenizer: object
    end_of_turn: str
    end_of_turn_id: int
    source: str
    thinking: bool | None = None
    context_length: int | None = None
    think_start_id: int | None = field(default=None)
    think_end_id: int | None = field(default=None)

    @classmethod
    def load(cls, path: Path | str, *, end_of_turn: str = "", trust_remote_code: bool = False,
             thinking: bool | None = None, config_dir: Path | str | None = None):
        """``config_dir``: where the model's ``config.json`` (context length) is, when the tokenizer
        lives elsewhere; default ``path``."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        kwargs = {} if thinking is None else {"thinking": thinking}
        turn_end = template_turn_end(tok, kwargs)
        eot = end_of_turn or (turn_end[0] if turn_end else tok.eos_token)
        if not eot:
            raise SpecialTokenError(f"{path}: tokenizer has no chat template turn end and no eos_token; "
                                    "configure end_of_turn explicitly")
        return cls(tok, eot, lookup_token_id(tok, eot), str(path), thinking=thinking,
                   context_length=_context_length(Path(config_dir or path), tok),
                   think_start_id=optional_token_id(tok, THINK_START),
                   think_end_id=optional_token_id(tok, THINK_END))

    @property
    def name(self) -> str:
        """The target's name as sample ids record it: the model directory's name."""
        return Path(self.source).name

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def special_ids(self) -> set[int]:
        return {i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special}

    @property
    def has_think_tokens(self) -> bool:
        return self.think_start_id is not None and self.think_end_id is not None

    def template_kwargs(self) -> dict:
        return {} if self.thinking is None else {"thinking": self.thinking}

    def render_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The prompt's ids with the generation prompt, tools passed to the template's own
        ``apply_chat_template`` (Kimi-K2.5's override turns them into its TypeScript declaration)."""
        kwargs = {"tools": tools} if tools else {}
        enc = self.tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=True, **kwargs, **self.template_kwargs()
        )
        return list(enc["input_ids"])

    def parse_tool_calls(self, output_ids: list[int]) -> list[dict] | None:
        """The calls a reply's ids make, in OpenAI's shape, when the target's format is known (Kimi)."""
        fmt = KimiFormat.of(self)
        return fmt.split(self, list(output_ids))[1] if fmt is not None else None

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders tool declarations at all (SmolLM2's does not)."""
        if "_supports_tools" not in self.__dict__:
            self.__dict__["_supports_tools"] = template_renders_tools(self.tokenizer, self.template_kwargs())
        return self.__dict__["_supports_tools"]

    def encode_text(self, text: str) -> list[int]:
        """Ids of text as the target's tokenizer encodes it (literal special strings included)."""
        if not text:
            return []
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def literal_specials(self, text: str) -> list[str]:
        """Special-token strings written literally in ``text`` (each occurrence), which encoding
        turns into special ids."""
        if not text or "<" not in text and "[" not in text:
            return []
        found = []
        for name in self.special_names:
            found += [name] * text.count(name)
        return found

    @property
    def special_names(self) -> list[str]:
        if "_special_names" not in self.__dict__:
            self.__dict__["_special_names"] = sorted(
                (t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special), key=len, reverse=True)
        return self.__dict__["_special_names"]

    def decode(self, ids: list[int]) -> str:
        # no spaces around added tokens: Kimi's slow tokenizer otherwise decodes
        # "<think>ok</think>1" as " <think> ok </think> 1" (vllm#33457)
        return self.tokenizer.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False)

    def opens_think(self, prompt_ids: list[int] | None) -> bool:
        """The generation prompt ends inside an open think block (K2.5's thinking prompt)."""
        return bool(prompt_ids) and self.has_think_tokens and prompt_ids[-1] == self.think_start_id

    def split_thinking(self, row: dict, prompt_ids: list[int] | None) -> tuple[str | None, str, bool | None]:
        """(reasoning, text, think_closed) of a row. A row whose text is its server's decode of its
        own ids (native ids, no separate reasoning) and whose prompt opened a think block holds
        ``reasoning</think>answer`` in ``text``: split it at the first ``</think>``; whether the
        block was closed is read from the ids. Other rows pass through (``think_closed`` None)."""
        text, reasoning, native = row.get("text") or "", row.get("reasoning"), row.get("output_ids")
        if native is None or reasoning is not None or not self.opens_think(prompt_ids):
            return reasoning, text, None
        closed = self.think_end_id in native
        if THINK_END in text:
            head, tail = text.split(THINK_END, 1)
            return head, tail, closed
        return (text, "", False) if not closed else ("", text, True)

    def completion_layout(self, prompt_ids: list[int] | None, reasoning: str | None, text: str,
                          finish_reason: str, think_closed: bool | None = None) -> list[str]:
        """The parts a re-tokenized completion is made of, in order (see the module docstring).
        ``think_closed``: whether the think block the prompt opened was closed, when known."""
        parts: list[str] = []
        stopped = finish_reason == "stop"
        last = prompt_ids[-1] if prompt_ids else None
        opens_think = self.opens_think(prompt_ids)
        closed_think = self.has_think_tokens and last == self.think_end_id  # thinking=False prompt
        if opens_think:
            # generation started inside the think block; a turn cut before any answer text
            # may not have closed it yet
            parts.append("reasoning")
            if think_closed or (think_closed is None and (text or stopped)):
                parts.append(THINK_END)
        elif reasoning and self.has_think_tokens and not closed_think:
            parts += [THINK_START, "reasoning", THINK_END]
        parts.append("text")
        if stopped:
            parts.append("end_of_turn")
        return parts

    def retokenize_completion(self, text: str, finish_reason: str, *, reasoning: str | None = None,
                              prompt_ids: list[int] | None = None, think_closed: bool | None = None) -> list[int]:
        """Completion ids rebuilt from text (and reasoning) the way the template's generating turn
        lays them out; end-of-turn appended if it stopped. Used for text-only rows *and* for the
        calibration of rows with native ids."""
        ids: list[int] = []
        for part in self.completion_layout(prompt_ids, reasoning, text or "", finish_reason or "", think_closed):
            if part == "reasoning":
                ids += self.encode_text(reasoning or "")
            elif part == "text":
                ids += self.encode_text(text or "")
            elif part == "end_of_turn":
                ids.append(self.end_of_turn_id)
            elif part == THINK_START:
                ids.append(self.think_start_id)
            elif part == THINK_END:
                ids.append(self.think_end_id)
        return ids

    def template_turn_end(self) -> tuple[str, int] | None:
        """The token the chat template closes an assistant turn with, or None if it cannot tell."""
        return template_turn_end(self.tokenizer, self.template_kwargs())


def template_turn_end(tokenizer, template_kwargs: dict | None = None) -> tuple[str, int] | None:
    """(string, id) of the first token after an assistant message's content in the chat template."""
    marker = "Zq9 marker"
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": marker}],
            tokenize=False, add_generation_prompt=False, **(template_kwargs or {}))
    except Exception:  # no chat template, or one that rejects this conversation
        return None
    rest = rendered[rendered.rfind(marker) + len(marker):] if marker in rendered else ""
    ids = list(tokenizer.encode(rest, add_special_tokens=False)) if rest else []
    if not ids:
        return None
    return tokenizer.convert_ids_to_tokens(ids[0]), int(ids[0])


def _context_length(path: Path, tokenizer) -> int | None:
    cfg = path / "config.json"
    if cfg.is_file():
        try:
            data = json.loads(cfg.read_text())
        except (OSError, ValueError):
            data = {}
        for d in (data, data.get("text_config") or {}):
            n = d.get("max_position_embeddings") or d.get("max_sequence_length")
            if isinstance(n, int) and n > 0:
                return n
    n = getattr(tokenizer, "model_max_length", None)
    return int(n) if isinstance(n, int) and 0 < n < _SANE_MAX else None
