"""Session fixtures (a pytest plugin of ``tests/conftest.py``): the small drafters of
``small_drafter.py`` trained once per session and exported for both engines, shared by the engine
tests that train the very same drafter.

Each fixture yields a directory holding the drafter's float32 ``vllm/`` export (speculators
format, or vLLM's MLA layout) and ``sglang/`` export, beside the ``features/`` it was trained on
and its ``train/`` folder; every test only reads them (a test that writes into a drafter directory
trains its own). Features (the target's greedy answers to ``TRAIN_QUESTIONS`` and their hidden
states) are shared too, between a 3.0 drafter and the 3.1 drafter (``fc_norm`` and
``norm_output`` on) of the same target.
"""

from __future__ import annotations

from pathlib import Path

import pytest

K = 3  # every shared drafter is trained and exported for a chain of 3
SWITCHES = {"fc_norm": True, "norm_output": True}  # EAGLE 3.1's
KIMI_MAX_NEW = 16  # the kimi-mini tests' reply length, that of the answers their drafters train on


def both_exports(features: Path, model_dir: Path, out_dir: Path, *, attention: str = "llama", **switches: bool) -> Path:
    """A drafter trained by ``small_drafter.train_on_features`` (40 steps) on ``features``, exported
    in float32 for vLLM (``out_dir/vllm``) and SGLang (``out_dir/sglang``); returns ``out_dir``."""
    from eagle3_assets.drafter import formats
    from tests.support import small_drafter

    model = small_drafter.train_on_features(features, model_dir, out_dir / "train", k=K, attention=attention, **switches)
    small_drafter.export_vllm_float(model, model_dir, out_dir / "vllm", k=K)
    formats.export("sglang", model, out_dir / "sglang", dtype="float32")
    return out_dir


@pytest.fixture(scope="session")
def smol_drafter_features(embedded, model_dir, tmp_path_factory) -> Path:
    """SmolLM2's greedy answers (up to 24 tokens) to ``TRAIN_QUESTIONS`` and their features."""
    from tests.support import small_drafter

    return small_drafter.answer_features(embedded, model_dir, tmp_path_factory.mktemp("smol-features"),
                                         small_drafter.TRAIN_QUESTIONS)


@pytest.fixture(scope="session")
def smol_drafter(smol_drafter_features, model_dir, tmp_path_factory) -> Path:
    """The 3.0 Llama-style drafter of SmolLM2 (what ``small_drafter.train_small_drafter`` trains)."""
    return both_exports(smol_drafter_features, model_dir, tmp_path_factory.mktemp("smol-drafter"))


@pytest.fixture(scope="session")
def smol_drafter_31(smol_drafter_features, model_dir, tmp_path_factory) -> Path:
    """The same with EAGLE 3.1's two switches on."""
    return both_exports(smol_drafter_features, model_dir, tmp_path_factory.mktemp("smol-drafter-31"), **SWITCHES)


@pytest.fixture(scope="session")
def kimi_embedded(kimi_mini_dir):
    """kimi-mini loaded as the embedded target, with Kimi's remote-code tokenizer."""
    from eagle3_assets.target.embedded import EmbeddedModel
    from eagle3_assets.target.tokenizer import TargetTokenizer

    return EmbeddedModel(kimi_mini_dir, tokenizer=TargetTokenizer.load(kimi_mini_dir, trust_remote_code=True))


@pytest.fixture(scope="session")
def kimi_drafter_features(kimi_embedded, kimi_mini_dir, tmp_path_factory) -> Path:
    """kimi-mini's greedy answers (up to 16 tokens) to ``TRAIN_QUESTIONS`` and their features."""
    from tests.support import small_drafter

    return small_drafter.answer_features(kimi_embedded, kimi_mini_dir, tmp_path_factory.mktemp("kimi-features"),
                                         small_drafter.TRAIN_QUESTIONS, max_new_tokens=KIMI_MAX_NEW)


@pytest.fixture(scope="session")
def kimi_mla_drafter(kimi_drafter_features, kimi_mini_dir, tmp_path_factory) -> Path:
    """The 3.0 MLA drafter of kimi-mini."""
    return both_exports(kimi_drafter_features, kimi_mini_dir, tmp_path_factory.mktemp("kimi-mla"), attention="mla")


@pytest.fixture(scope="session")
def kimi_mla_drafter_31(kimi_drafter_features, kimi_mini_dir, tmp_path_factory) -> Path:
    """The MLA drafter of kimi-mini with EAGLE 3.1's two switches on."""
    return both_exports(kimi_drafter_features, kimi_mini_dir, tmp_path_factory.mktemp("kimi-mla-31"), attention="mla",
                        **SWITCHES)
