"""A small stand-in for Kimi K2.5's tokenizer, built locally for tests (no download).

What it mirrors (docs: sglang-and-kimi.md section C):
- base vocabulary first, then 256 special/reserved slots starting at ``num_base_tokens``, in
  Kimi's relative order: ``[BOS]`` +0, ``[EOS]`` +1, ``<|im_end|>`` +2, ``<|im_user|>`` +3,
  ``<|im_assistant|>`` +4, ``<|start_header_id|>`` +6, ``<|end_header_id|>`` +7, ``[EOT]`` +9,
  ``<|im_system|>`` +10, tool-call markers +11..+15, ``<|im_middle|>`` +17, media +18..+21,
  ``<think>`` +22, ``</think>`` +23, ``[UNK]`` +254, ``[PAD]`` +255; unnamed slots are
  ``<|reserved_token_{i}|>``;
- ``special=False`` for ``<think>``, ``</think>`` and the tool-call markers, as in Kimi;
- ``eos_token`` is ``[EOS]`` although turns end with ``<|im_end|>`` (so the end of a turn must be
  configured/looked up, not taken from ``eos_token`` blindly);
- a chat template with K2.5's structure (no newlines between turns, ``<think></think>`` on
  history assistant turns, ``<think>{reasoning}</think>`` on assistant turns after the last user
  message, generation prompt ``...<|im_middle|><think>`` or ``...<think></think>`` with
  ``thinking=False``).

What it does not mirror: Kimi's tiktoken merges and its pre-tokenizer regex (this is a small
byte-level BPE trained on the text below), so ids of ordinary text differ from Kimi's.
"""

from __future__ import annotations

from pathlib import Path

# Kimi's named slots, relative to num_base_tokens, and whether each is special.
KIMI_SLOTS: dict[int, tuple[str, bool]] = {
    0: ("[BOS]", True), 1: ("[EOS]", True), 2: ("<|im_end|>", True), 3: ("<|im_user|>", True),
    4: ("<|im_assistant|>", True), 6: ("<|start_header_id|>", True), 7: ("<|end_header_id|>", True),
    9: ("[EOT]", True), 10: ("<|im_system|>", True),
    11: ("<|tool_calls_section_begin|>", False), 12: ("<|tool_calls_section_end|>", False),
    13: ("<|tool_call_begin|>", False), 14: ("<|tool_call_argument_begin|>", False), 15: ("<|tool_call_end|>", False),
    17: ("<|im_middle|>", True), 18: ("<|media_begin|>", True), 19: ("<|media_content|>", True),
    20: ("<|media_end|>", True), 21: ("<|media_pad|>", True),
    22: ("<think>", False), 23: ("</think>", False),
    254: ("[UNK]", True), 255: ("[PAD]", True),
}
NUM_SLOTS = 256
BASE_VOCAB = 1024  # the trainer's target; the real base size is whatever training produced

CHAT_TEMPLATE = (
    "{%- macro content(m) -%}"
    "{%- if m['content'] is string -%}{{ m['content'] }}"
    "{%- elif m['content'] is not none -%}{%- for p in m['content'] -%}"
    "{%- if p['type'] == 'text' -%}{{ p['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<|im_system|>system<|im_middle|>{{ content(m) }}<|im_end|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>{{ m.get('name') or 'user' }}<|im_middle|>{{ content(m) }}<|im_end|>"
    "{%- elif m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- set r = m.get('reasoning_content') or m.get('reasoning') or '' -%}"
    "{%- if loop.index0 > ns.last_user and thinking is not false -%}<think>{{ r }}</think>"
    "{%- else -%}<think></think>{%- endif -%}"
    "{{ content(m) }}"
    "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for tc in m['tool_calls'] -%}<|tool_call_begin|>functions.{{ tc['function']['name'] }}:{{ loop.index0 }}"
    "<|tool_call_argument_begin|>{{ tc['function']['arguments'] }}<|tool_call_end|>{%- endfor -%}"
    "<|tool_calls_section_end|>{%- endif -%}"
    "<|im_end|>"
    "{%- elif m['role'] == 'tool' -%}<|im_system|>{{ m.get('name') or 'tool' }}<|im_middle|>"
    "## Return of {{ m.get('tool_call_id') }}\n{{ content(m) }}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)

_TRAINING_TEXT = """\
You are Kimi, an AI assistant created by Moonshot AI. The user asks a question and the assistant answers.
What is the capital of France? The capital of France is Paris. What is 2+3? The answer is 5.
Let me think step by step. First, add the numbers. Then check the result. So the answer is correct.
The quick brown fox jumps over the lazy dog. She chased the cat across the chasm; the chase was long.
Chasing shadows, the chassis rattled. chas chas chas chasm chase chased chasing chaste.
chas: an ordinary late merge, like Kimi's id 163533.
def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n
import numpy as np\nx = np.array([1, 2, 3])\nfor i in range(10):\n    print(i * i)\n
Speculative decoding uses a small draft model to propose tokens and the target model verifies them.
Training data for the drafter is generated by the target model itself, token by token, with its own ids.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2024 2025 3.14159 42 -7 1e6.
Punctuation: , . ; : ! ? ( ) [ ] { } " ' - -- ... / \\ | @ # $ % ^ & * + = < > ~ `
你好，世界。我们今天学习中文。机器学习和人工智能。谢谢！
こんにちは、世界。日本語のテキストです。
Привет, мир! Это тест. Café, naïve, résumé, façade, São Paulo, Zürich, Ångström.
Emoji: 😀 🎉 👍 🚀 ❤️ 🤖 ✅
"""


def _training_iterator():
    for _ in range(20):
        yield from _TRAINING_TEXT.splitlines(keepends=True)


def build_kimi_test_tokenizer(out_dir: Path | str) -> Path:
    """Write the test tokenizer to ``out_dir`` (a Hugging Face tokenizer directory) and return it.

    Deterministic: the same files every time. Loads with ``AutoTokenizer.from_pretrained``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BASE_VOCAB, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
    )
    tk.train_from_iterator(_training_iterator(), trainer=trainer)
    base = tk.get_vocab_size()
    for slot in range(NUM_SLOTS):  # one at a time so each lands at base + slot
        name, special = KIMI_SLOTS.get(slot, (f"<|reserved_token_{base + slot}|>", True))
        token = AddedToken(name, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        added = tk.add_special_tokens([token]) if special else tk.add_tokens([token])
        assert added == 1 and tk.token_to_id(name) == base + slot, (name, slot)
    extra = [n for s, (n, sp) in sorted(KIMI_SLOTS.items()) if sp and n not in ("[BOS]", "[EOS]", "[UNK]", "[PAD]")]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]", pad_token="[PAD]",
        additional_special_tokens=extra, model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    # a model config, so the context length is known the way a checkpoint's config.json gives it
    (out / "config.json").write_text(
        f'{{"max_position_embeddings": 4096, "eos_token_id": {base + 2}}}\n'
    )
    return out
