"""The MLA drafter (``attention = "mla"``) without a served engine: its attention against
transformers' DeepSeek-V3 attention on the same weights, training-time test against chain
decoding, and both exports against what vLLM's and SGLang's DeepSeek EAGLE-3 loaders read.

Scale: a random 7-layer MLA target config with Kimi-K2.5's latent (512 + 64), yarn rope and a
300-id vocabulary; a K2.5 drafter has hidden 7,168 and 64 heads, the same code paths.
"""

import json

import pytest
import torch

from eagle3_assets.drafter import formats
from eagle3_assets.drafter.model import DrafterConfig, KVCache, build_drafter
from eagle3_assets.drafter.vocab_map import build_vocab_map

TEXT = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 300, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 32, "kv_lora_rank": 512, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 262144, "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}
TARGET = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": TEXT}


@pytest.fixture(scope="module")
def model():
    cfg = DrafterConfig.from_target(TARGET, draft_vocab_size=40, attention="mla")
    vmap = build_vocab_map(torch.arange(300, 0, -1, dtype=torch.long), 40)
    return build_drafter(cfg, torch.randn(300, 64, generator=torch.Generator().manual_seed(1)), vmap, seed=2).eval()


def test_mla_attention_equals_transformers_deepseek_v3_attention(model):
    """Same weights, same 2H-wide input: rope layout, yarn magnitude and softmax scale all agree."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    ours = model.midlayer.self_attn
    hf_cfg = DeepseekV3Config(**{**{k: v for k, v in TEXT.items() if k not in ("architectures", "model_type")},
                                 "hidden_size": 128, "attention_bias": False})  # attention input is 2H wide
    hf_cfg._attn_implementation = "sdpa"
    theirs = DeepseekV3Attention(hf_cfg, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name == "o_proj.weight":  # theirs maps back to 2H: ours in the first H rows
                p.zero_()
                p[:64] = ours.o_proj.weight
            else:
                p.copy_(ours.get_parameter(name))
        x = torch.randn(2, 9, 128)
        pos = torch.arange(3, 12)[None].expand(2, -1)
        cos, sin = model.rotary(pos, x.dtype)
        mine = ours(x, cos, sin, KVCache())
        ref, _ = theirs(x, DeepseekV3RotaryEmbedding(hf_cfg)(x, pos), attention_mask=None)
    torch.testing.assert_close(mine, ref[..., :64], atol=2e-5, rtol=1e-4)


def test_mla_ttt_matches_chain_decoding(model):
    g = torch.Generator().manual_seed(3)
    ids, aux = torch.randint(0, 300, (1, 20), generator=g), torch.randn(1, 20, 192, generator=g)
    with torch.no_grad():
        out = model(ids, aux, ttt_steps=3)
        for t in (0, 7, 16):
            cache = KVCache()
            hid = model.step(ids[:, 1: t + 2], model.project_aux(aux[:, : t + 1]), torch.arange(t + 1)[None], cache)[:, -1:]
            torch.testing.assert_close(model.logits(hid)[0, 0], out[0][0, t], atol=1e-4, rtol=1e-4)
            for step in (1, 2):
                hid = model.step(ids[:, t + 1 + step: t + 2 + step], hid, torch.tensor([[t + step]]), cache)
                torch.testing.assert_close(model.logits(hid)[0, 0], out[step][0, t], atol=1e-4, rtol=1e-4)


def test_mla_exports_are_what_both_engines_load(model, tmp_path):
    sg = formats.export("sglang", model, tmp_path / "sglang", dtype="float32")
    vl = formats.export("vllm", model, tmp_path / "vllm", dtype="float32")
    assert formats.check("sglang", sg) == [] and formats.check("vllm", vl) == []
    s_cfg, v_cfg = (json.loads((d / "config.json").read_text()) for d in (sg, vl))
    for c in (s_cfg, v_cfg):
        assert c["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and c["model_type"] == "deepseek_v2"
        assert (c["kv_lora_rank"], c["qk_rope_head_dim"], c["num_hidden_layers"]) == (512, 64, 1)
        assert c["rope_scaling"]["mscale_all_dim"] == 1.0 and c["rope_parameters"]["rope_type"] == "yarn"
    assert s_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # SGLang: output of layer k
    assert v_cfg["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4] and v_cfg["norm_before_residual"] is False
    emb = model.embed_tokens.weight.detach()
    g = torch.Generator().manual_seed(4)
    ids, aux = torch.randint(0, 300, (1, 12), generator=g), torch.randn(1, 12, 192, generator=g)
    with torch.no_grad():
        want = model(ids, aux, ttt_steps=2)
        for back in (formats.load("sglang", sg, emb), formats.load("vllm", vl)):
            assert back.config == model.config
            for a, b in zip(back(ids, aux, ttt_steps=2), want):
                torch.testing.assert_close(a, b)


def test_mla_export_checks_refuse_what_an_engine_would_misread(model, tmp_path):
    out = formats.export("vllm", model, tmp_path / "vllm", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    bad = {**cfg, "model_type": "deepseek_v3", "norm_before_residual": None,
           "rope_scaling": {k: v for k, v in cfg["rope_scaling"].items() if k != "mscale_all_dim"}}
    (out / "config.json").write_text(json.dumps(bad))
    problems = formats.check("vllm", out)
    assert any("MTP" in p for p in problems) and any("norm_before_residual" in p for p in problems)
    assert any("mscale_all_dim" in p for p in problems)


def test_mla_needs_an_mla_target():
    llama = {**{k: v for k, v in TEXT.items() if k not in ("kv_lora_rank", "q_lora_rank")}, "head_dim": 16}
    with pytest.raises(ValueError, match="needs an MLA target"):
        DrafterConfig.from_target(llama, draft_vocab_size=40, attention="mla")
    with pytest.raises(ValueError, match="attention must be one of"):
        DrafterConfig.from_target(TARGET, draft_vocab_size=40, attention="gqa")
