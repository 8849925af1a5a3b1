"""kimi-mini's cached build: a copy made by another builder is rebuilt (a template edit must reach
every machine that built an older copy), and the rebuilt copy renders K2.5's published example."""

from eagle3_assets.target.kimi_mini import builder_stamp, ensure_kimi_mini
from eagle3_assets.target.tokenizer import TargetTokenizer

# Kimi-K2.5's tokenizer.apply_chat_template([{"role": "user", "content": "What is 1+1?"}]) as its
# model card's guides print it: the default system turn, then the thinking generation prompt.
K25_ONE_PLUS_ONE = ("<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
                    "<|im_user|>user<|im_middle|>What is 1+1?<|im_end|><|im_assistant|>assistant<|im_middle|><think>")


def test_a_copy_from_another_builder_is_rebuilt(tmp_path):
    out = ensure_kimi_mini(tmp_path)
    stamp = out / "SOURCE"
    assert stamp.read_text().strip() == builder_stamp()
    template = out / "chat_template.jinja"
    stamp.write_text("kimi-mini builder v4\n")  # what a machine that built the older template holds
    template.write_text("{{ messages[0]['content'] }}")
    assert ensure_kimi_mini(tmp_path) == out
    assert stamp.read_text().strip() == builder_stamp()
    assert "You are Kimi" in template.read_text()
    tok = TargetTokenizer.load(out, trust_remote_code=True)
    assert tok.tokenizer.apply_chat_template([{"role": "user", "content": "What is 1+1?"}]) == K25_ONE_PLUS_ONE


def test_an_edited_builder_file_changes_the_stamp(tmp_path):
    """An edit to the template (or any builder file) without a version bump still changes the stamp,
    so the cached copy is rebuilt: what went wrong when the default system turn was added."""
    import shutil
    from pathlib import Path

    import eagle3_assets.target.kimi_mini as kimi_mini

    copy = tmp_path / "kimi_mini"
    shutil.copytree(Path(kimi_mini.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert builder_stamp(copy) == builder_stamp()
    template = copy / "chat_template.jinja"
    template.write_text(template.read_text() + "\n")
    assert builder_stamp(copy) != builder_stamp()
