"""The reference run's converters (benchmarks/reference_convert.py) on a tiny random Llama target:
our shards out to speculators' per-sample files (train split only, final state before the norm),
a speculators checkpoint back into the project's drafter and SGLang export."""

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_assets.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_assets.hidden_states.shards import ShardWriter
from eagle3_assets.paths import REPO_ROOT
from eagle3_assets.target import layers as hidden_layers

AUX = [1, 3, 5]  # "output of layer k" ids of the 8-layer stand-in; speculators' ids are these + 1
LENGTHS = [9, 14, 7, 12, 10]
SPLITS = ["train", "eval", "train", "train", "eval"]


def _module():
    spec = importlib.util.spec_from_file_location("reference_convert", REPO_ROOT / "benchmarks" / "reference_convert.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rc = _module()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 2.0)  # a final norm that is not the identity
    out = tmp_path_factory.mktemp("target")
    model.save_pretrained(out)
    return out, model


@pytest.fixture(scope="module")
def shards(target, tmp_path_factory):
    """A hidden-state dataset written by the project's ShardWriter from the stand-in's own states."""
    from eagle3_assets.drafter.spec_decode import aux_from_hidden_states

    _, model = target
    out = tmp_path_factory.mktemp("hs")
    meta = {"target": {"name": "tiny"}, "layers": hidden_layers.convention(AUX, 8)}
    writer = ShardWriter(out, hidden_size=32, shard_bytes=4000, meta=meta, background=False)
    g = torch.Generator().manual_seed(1)
    for i, (n, split) in enumerate(zip(LENGTHS, SPLITS)):
        ids = torch.randint(3, 128, (n,), generator=g)
        with torch.no_grad():
            res = model.model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
        aux = aux_from_hidden_states(res.hidden_states, AUX)[0]
        writer.add(f"s{i}", split, ids.tolist(), [0] * (n // 2) + [1] * (n - n // 2), aux, res.hidden_states[-1][0])
    writer.close()
    return out


def test_train_split_to_speculators_files(target, shards, tmp_path):
    from eagle3_assets.hidden_states.reader import ShardReader

    target_dir, model = target
    rec = rc.to_speculators(shards, tmp_path, target_dir)
    reader = ShardReader(shards)
    train = reader.sample_ids("train")
    assert rec["samples"] == len(train) == 3 and rec["speculators_layer_ids"] == [2, 4, 6]
    rows = [json.loads(x) for x in (tmp_path / rc.ROWS).read_text().splitlines()]
    assert [r["sample_id"] for r in rows] == train and [r["index"] for r in rows] == [0, 1, 2]
    assert sorted(p.name for p in (tmp_path / rc.HS_DIR).iterdir()) == [f"hs_{i}.safetensors" for i in range(3)]
    for i, sid in enumerate(train):
        s = reader.read(sid)
        hs = load_file(str(rc.hs_file(tmp_path, i)))
        assert hs["token_ids"].dtype == torch.int64 and torch.equal(hs["token_ids"], s.input_ids)
        assert rows[i]["loss_mask"] == s.loss_mask.tolist()
        assert hs["hidden_states"].shape == (len(s), 4, 32) and hs["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(hs["hidden_states"][:, :3].flatten(1), s.aux_hidden)  # aux copied as stored
        pre = hs["hidden_states"][:, 3].float()  # the state before the target's final norm ...
        assert not torch.allclose(pre, s.last_hidden.float(), atol=1e-2)
        with torch.no_grad():  # ... which the norm turns into the stored post-norm state (bf16 apart)
            torch.testing.assert_close(model.model.norm(pre), s.last_hidden.float(), rtol=2e-2, atol=2e-2)
    worst = rec["recomputed_vs_stored"]
    assert worst["aux_max_rel"] < 1e-2 and worst["post_norm_max_rel"] < 2e-2
    with pytest.raises(ValueError, match="held out"):
        rc.to_speculators(shards, tmp_path / "no", target_dir, split="eval")


def _drafter(target_dir) -> Eagle3Drafter:
    from eagle3_assets.drafter.target_weights import read_target_embeddings

    cfg = DrafterConfig.from_target(json.loads((target_dir / "config.json").read_text()), draft_vocab_size=16,
                                    aux_layer_ids=AUX, intermediate_size=48)
    model = Eagle3Drafter(cfg).init_weights(3).set_embeddings(read_target_embeddings(target_dir))
    chosen = torch.arange(0, 128, 8)
    model.d2t.copy_(chosen - torch.arange(16))
    model.t2d.zero_()
    model.t2d[chosen] = True
    return model.eval()


def _speculators_checkpoint(model: Eagle3Drafter, out, **flags):
    """A checkpoint in speculators 0.9's layout holding ``model``'s weights."""
    c = model.config
    config = {
        "speculators_model_type": "eagle3", "architectures": ["Eagle3DraftModel"], "draft_vocab_size": c.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in c.aux_layer_ids],
        "norm_before_fc": False, "norm_before_residual": False, "norm_output": False, "fc_norm": False,
        "transformer_layer_config": {"model_type": "llama", "num_hidden_layers": 1, "layer_types": ["full_attention"],
                                     "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                                     "num_attention_heads": c.num_attention_heads, "head_dim": c.head_dim,
                                     "num_key_value_heads": c.num_key_value_heads, "use_sliding_window": False},
        **flags,
    }
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config))
    weights = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v.to(torch.bfloat16)
               if v.is_floating_point() else v for k, v in model.state_dict().items()}
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    return out


def test_speculators_checkpoint_to_project_export(target, tmp_path):
    from eagle3_assets.drafter.evaluate import load_export
    from eagle3_assets.drafter.target_weights import read_target_embeddings

    target_dir, _ = target
    ours = _drafter(target_dir)
    ckpt = _speculators_checkpoint(ours, tmp_path / "ckpt")
    back = rc.drafter_from_speculators(ckpt, target_dir)
    assert back.config.aux_layer_ids == AUX and back.config.intermediate_size == 48
    for k, v in ours.state_dict().items():
        want = v.to(torch.bfloat16).float() if v.is_floating_point() and not k.startswith("embed_tokens") else v
        assert torch.equal(back.state_dict()[k], want), k
    sglang = rc.to_project(ckpt, tmp_path / "drafter", target_dir)
    cfg = json.loads((sglang / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX
    loaded = load_export(tmp_path / "drafter", read_target_embeddings(target_dir))
    for k, v in back.state_dict().items():
        assert torch.equal(loaded.state_dict()[k].float() if v.is_floating_point() else loaded.state_dict()[k], v), k


@pytest.mark.parametrize("flags, problem", [
    ({"norm_before_fc": True}, "norm_before_fc"), ({"norm_output": True}, "norm_output"),
    ({"norm_before_residual": True}, "norm_before_residual"),
    ({"transformer_layer_config": {"model_type": "llama", "num_hidden_layers": 1, "layer_types": ["sliding_attention"]}},
     "sliding-window"),
    ({"transformer_layer_config": {"model_type": "llama", "num_hidden_layers": 2}}, "2 decoder layers"),
])
def test_layouts_the_drafter_cannot_hold_are_refused(target, tmp_path, flags, problem):
    target_dir, _ = target
    ckpt = _speculators_checkpoint(_drafter(target_dir), tmp_path / "ckpt", **flags)
    with pytest.raises(ValueError, match=problem):
        rc.drafter_from_speculators(ckpt, target_dir)


def test_draft_agreement_counts_every_shifted_position(target, tmp_path):
    """speculators drafts on its shifted row (token t + 1 with the features of token t, so T - 1
    positions); the project's forward at index t reads the same token and features."""
    target_dir, _ = target
    model = _drafter(target_dir)
    g = torch.Generator().manual_seed(5)
    tensors = {}
    for i, n in enumerate([11, 6]):
        ids, aux = torch.randint(3, 128, (n,), generator=g), torch.randn(n, 3 * 32, generator=g)
        with torch.no_grad():
            drafts = torch.stack([lg[0, : n - 1].argmax(-1) for lg in model(ids[None], aux[None], ttt_steps=3)])
        if i == 1:
            drafts[2, 0] = (drafts[2, 0] + 1) % 16  # one disagreement at step 2
        tensors.update({f"input_ids.{i}": ids, f"aux.{i}": aux, f"steps.{i}": torch.tensor(3), f"draft_ids.{i}": drafts})
    tensors["count"] = torch.tensor(2)
    save_file(tensors, str(tmp_path / "parity.safetensors"))
    rates = rc.draft_agreement(model, tmp_path / "parity.safetensors")
    assert rates["rows"] == 2 and rates["positions"] == 10 + 5
    assert rates["per_step"] == [1.0, 1.0, round(14 / 15, 5)]
