"""Kimi-K2.5's path through SGLang's own EAGLE-3 worker (marked sglang): kimi-mini with an MLA drafter
(``Eagle3DeepseekV2ForCausalLM``, its SGLang export) on SGLang's CPU engine.

On SGLang 0.5.23 this does not get as far as a forward pass: SGLang's K2.5 multimodal processor
(``multimodal/processors/kimi_k25.py``) reads ``processor.media_processor.media_proc_cfg``, which
kimi-mini's remote-code processor does not have (it names its image processor ``image_processor``),
and SGLang refuses ``--language-model-only`` for ``KimiK25ForConditionalGeneration``. The test pins
that first failure, so the day kimi-mini or SGLang changes it fails and the acceptance check for the
MLA drafter (docs/sglang.md) can be written against a server that runs.
"""

from __future__ import annotations

import pytest
import torch

from eagle3_assets.target.sglang_server import SGLangServer, SGLangServerError

pytestmark = [pytest.mark.sglang, pytest.mark.model]


def test_sglang_stops_at_kimi_mini_s_processor_before_any_mla_op(kimi_mini_dir, tmp_path, one_torch_thread):
    from eagle3_assets.drafter.export import export_sglang
    from eagle3_assets.drafter.model import DrafterConfig, build_drafter
    from eagle3_assets.drafter.target_weights import read_target_config, read_target_embeddings
    from eagle3_assets.drafter.vocab_map import build_vocab_map

    cfg = read_target_config(kimi_mini_dir)
    vocab = (cfg.get("text_config") or cfg)["vocab_size"]
    dcfg = DrafterConfig.from_target(cfg, draft_vocab_size=8192, intermediate_size=256, attention="mla")
    drafter = build_drafter(dcfg, read_target_embeddings(kimi_mini_dir), build_vocab_map(torch.ones(vocab), 8192))
    export = export_sglang(drafter, tmp_path / "mla", dtype="float32")  # the MLA-draft requirement is checked here
    server = SGLangServer(kimi_mini_dir, attention_backend="intel_amx", drafter_dir=export, workdir=tmp_path / "srv")
    assert "--trust-remote-code" in server.command()
    with pytest.raises(SGLangServerError, match="has no attribute 'media_processor'"):
        with server:
            pass
