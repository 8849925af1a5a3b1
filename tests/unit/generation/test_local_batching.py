"""Local generation batches by length: one long prompt never pads the short ones.

The issue's case at full size is one ~40k-token prompt among short ones; sorting alone put it in
the last batch of 16, padding 15 short prompts to 40k tokens each (640k positions instead of 40k).
The model test uses a ~300-token prompt so it runs in seconds on a CPU.
"""

import pytest

from eagle3_assets.engines.http.samples import SamplingSettings, plan_samples
from eagle3_assets.generation.budget import TokenBudget
from eagle3_assets.generation.local import generate_local, length_batches
from eagle3_assets.generation.response_store import ResponseStore
from eagle3_assets.prompts.rows import Prompt


def positions(lengths, batches, max_new_tokens):
    return sum(len(b) * (max(lengths[i] for i in b) + max_new_tokens) for b in batches)


def test_one_long_prompt_runs_alone():
    lengths = [30 + (7 * i) % 40 for i in range(31)] + [40_000]
    batches = length_batches(lengths, 16, max_new_tokens=256)
    assert [31] in batches
    assert all(len(b) <= 16 for b in batches) and sorted(i for b in batches for i in b) == list(range(32))
    short = [b for b in batches if 31 not in b]
    assert len(short) == 2  # the 31 short prompts still fill batches
    old = [sorted(range(32), key=lengths.__getitem__)[k:k + 16] for k in (0, 16)]
    assert positions(lengths, old, 256) > 12 * positions(lengths, batches, 256)  # 648,960 vs 49,995


def test_batches_follow_length_and_memory_bounds():
    assert length_batches([], 16) == []
    assert length_batches([5, 3, 4], 2) == [[1, 2], [0]]
    # similar lengths fill batches; a doubling with few new tokens starts a new one
    assert length_batches([100] * 4 + [200] * 4, 16, max_new_tokens=8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # with many new tokens the padding is a small share of the work: one batch
    assert length_batches([100] * 4 + [200] * 4, 16, max_new_tokens=1024) == [list(range(8))]
    # rows x (width + new tokens) stays under the cap
    assert max(len(b) for b in length_batches([3000] * 40, 64, max_new_tokens=256, max_batch_tokens=32768)) == 10


@pytest.mark.model
def test_generate_local_keeps_the_long_prompt_out_of_short_batches(embedded, tmp_path):
    long_text = "Summarize: " + " ".join(f"item {i} is {i * 7 % 13}." for i in range(50))
    prompts = [Prompt(f"s{i}", [{"role": "user", "content": f"Say {i}."}], i) for i in range(5)]
    prompts.insert(2, Prompt("long", [{"role": "user", "content": long_text}], 99))
    widths = []
    real = embedded.generate

    def recording(batch, **kw):
        widths.append(sorted(len(p) for p in batch))
        return real(batch, **kw)

    embedded.generate = recording
    try:
        settings = SamplingSettings(target=embedded.name)
        rep = generate_local(embedded, plan_samples("b", prompts, settings), ResponseStore(tmp_path), settings,
                             TokenBudget(10**6), max_new_tokens=2, batch_size=8)
    finally:
        embedded.generate = real
    long_len = len(embedded.render_prompt(prompts[2].messages))
    assert long_len > 250
    assert [long_len] in widths and len(widths) == 2 and rep.new == 6
    assert max(max(w) for w in widths if long_len not in w) < 40
