"""EAGLE 3.1's two switches (``fc_norm``, ``norm_output``) for both drafter kinds: the network they
make (checked against the norms applied by hand), training with them, both engines' exports read
back to the same outputs, a 3.0 export still loading with both off, the checks, the refusal rule,
and the vocabulary map keyed by its sizes and its corpus.

Scale: the Llama-style drafter of hidden 32 and the MLA drafter of ``test_drafter_mla.py`` (hidden
64, Kimi-K2.5's latent), 300-id vocabulary; every case runs in well under a second.
"""

import copy
import json
from itertools import product

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_assets.drafter import export_files, formats
from eagle3_assets.drafter.model import DrafterConfig, KVCache, build_drafter
from eagle3_assets.drafter.recipes import RecipeError, parse_recipe
from eagle3_assets.drafter.training.config import DraftShape, TrainSettings
from eagle3_assets.drafter.training.loop import train
from eagle3_assets.drafter.training.teacher import Teacher
from eagle3_assets.drafter.vocab_map import load_or_build_vocab_map
from tests.unit.drafter.test_drafter_mla import TARGET as MLA_TARGET
from tests.unit.drafter.test_drafter_recipe_options import Batches, batch_of, tiny_drafter

COMBOS = list(product([False, True], [False, True]))  # (fc_norm, norm_output)


def drafter(kind: str, fc_norm: bool, norm_output: bool, seed: int = 2):
    """A drafter of ``kind`` whose norms are not all ones (so every norm changes the outputs)."""
    if kind == "llama":
        model = tiny_drafter(seed, fc_norm=fc_norm, norm_output=norm_output)[0]
    else:
        from eagle3_assets.drafter.vocab_map import build_vocab_map

        cfg = DrafterConfig.from_target(MLA_TARGET, draft_vocab_size=40, attention="mla", fc_norm=fc_norm,
                                        norm_output=norm_output)
        vmap = build_vocab_map(torch.arange(300, 0, -1, dtype=torch.long), 40)
        model = build_drafter(cfg, torch.randn(300, 64, generator=torch.Generator().manual_seed(1)), vmap, seed=seed)
    g = torch.Generator().manual_seed(seed + 10)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.startswith("fc_norm."):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    return model.eval()


def inputs(model, n=14, seed=4):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, model.config.vocab_size, (1, n), generator=g),
            3 * torch.randn(1, n, 3 * model.config.target_hidden_size, generator=g))


def by_hand(model, ids, aux, steps):
    """The TTT logits with every norm written out: per-layer RMSNorm before fc, and the state the
    next step reads (post-norm with norm_output), at each position's chain."""
    cfg = model.config

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    if cfg.fc_norm:
        aux = torch.cat([rms(c, n.weight) for c, n in zip(aux.chunk(3, -1), model.fc_norm)], -1)
    out, n = [], ids.shape[1]
    for t in range(n - 1):
        cache, hid = KVCache(), model.fc(aux[:, : t + 1])
        pre = model.step(ids[:, 1: t + 2], hid, torch.arange(t + 1)[None], cache)[:, -1:]
        row = [model.logits(pre)[0, 0]]
        for s in range(1, steps):
            if t + 1 + s >= n:
                break
            fed = rms(pre, model.norm.weight) if cfg.norm_output else pre
            pre = model.step(ids[:, t + 1 + s: t + 2 + s], fed, torch.tensor([[t + s]]), cache)
            row.append(model.logits(pre)[0, 0])
        out.append(row)
    return out


@pytest.mark.parametrize("kind", ["llama", "mla"])
@pytest.mark.parametrize("fc_norm,norm_output", COMBOS)
def test_the_switches_make_the_network_the_engines_run(kind, fc_norm, norm_output):
    model = drafter(kind, fc_norm, norm_output)
    ids, aux = inputs(model)
    with torch.no_grad():
        ttt = model(ids, aux, ttt_steps=3)
        for t, row in enumerate(by_hand(model, ids, aux, 3)):
            for s, want in enumerate(row):
                torch.testing.assert_close(ttt[s][0, t], want, atol=2e-4, rtol=2e-4)
        plain = copy.deepcopy(model)
        plain.config = DrafterConfig.from_dict({**model.config.to_dict(), "fc_norm": False, "norm_output": False})
        other = plain(ids, aux, ttt_steps=3)
    # step 0 sees fc_norm alone, later steps norm_output too: each switch changes what it must
    assert torch.allclose(other[0], ttt[0], atol=1e-5) != fc_norm
    assert torch.allclose(other[2][:, :8], ttt[2][:, :8], atol=1e-5) != (fc_norm or norm_output)


@pytest.mark.parametrize("kind", ["llama", "mla"])
@pytest.mark.parametrize("fc_norm,norm_output", COMBOS)
def test_both_exports_read_back_to_the_same_outputs(kind, fc_norm, norm_output, tmp_path):
    model = drafter(kind, fc_norm, norm_output)
    ids, aux = inputs(model)
    emb = model.embed_tokens.weight.detach()
    exports = {"sglang": formats.export("sglang", model, tmp_path / "s", dtype="float32"),
               "vllm": formats.export("vllm", model, tmp_path / "v", dtype="float32")}
    with torch.no_grad():
        want = model(ids, aux, ttt_steps=3)
    for engine, out in exports.items():
        assert formats.check(engine, out) == []
        c = json.loads((out / "config.json").read_text())
        assert (c["fc_norm"], c["norm_output"]) == (fc_norm, norm_output)  # at the top level, where engines read
        names = set(load_file(str(out / "model.safetensors")))
        assert {n for n in names if n.startswith("fc_norm")} == (set(export_files.FC_NORM_WEIGHTS) if fc_norm else set())
        back = formats.load(engine, out, None if engine == "vllm" else emb)
        assert back.config == model.config
        with torch.no_grad():
            for a, b in zip(back(ids, aux, ttt_steps=3), want):
                torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_a_3_0_export_without_the_keys_loads_with_both_off(kind, tmp_path):
    model = drafter(kind, False, False)
    ids, aux = inputs(model)
    for engine in ("sglang", "vllm"):
        out = formats.export(engine, model, tmp_path / engine, dtype="float32")
        c = json.loads((out / "config.json").read_text())
        del c["fc_norm"], c["norm_output"]
        (out / "config.json").write_text(json.dumps(c))
        assert formats.check(engine, out) == []
        back = formats.load(engine, out, model.embed_tokens.weight.detach())
        assert not back.config.fc_norm and not back.config.norm_output and not hasattr(back, "fc_norm")
        with torch.no_grad():
            for a, b in zip(back(ids, aux, ttt_steps=2), model(ids, aux, ttt_steps=2)):
                torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_checks_refuse_a_switch_its_weights_contradict(kind, tmp_path):
    on = drafter(kind, True, True)
    for engine in ("sglang", "vllm"):
        out = formats.export(engine, on, tmp_path / engine, dtype="float32")
        c = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**c, "fc_norm": False}))
        assert any("fc_norm is off but model.safetensors holds" in p for p in formats.check(engine, out))
        (out / "config.json").write_text(json.dumps({**c, "norm_output": "yes"}))
        assert any("norm_output is 'yes', not a boolean" in p for p in formats.check(engine, out))
        (out / "config.json").write_text(json.dumps(c))
        weights = load_file(str(out / "model.safetensors"))
        del weights["fc_norm.1.weight"]
        save_file(weights, str(out / "model.safetensors"))
        assert any("fc_norm is on but model.safetensors lacks ['fc_norm.1.weight']" in p for p in formats.check(engine, out))


def test_sglang_reads_fc_norm_under_its_older_name(tmp_path):
    model = drafter("llama", True, False)
    out = formats.export("sglang", model, tmp_path / "s", dtype="float32")
    c = json.loads((out / "config.json").read_text())
    del c["fc_norm"]
    (out / "config.json").write_text(json.dumps({**c, "use_aux_norm": True}))
    assert formats.check("sglang", out) == []
    assert formats.load("sglang", out, model.embed_tokens.weight.detach()).config.fc_norm


# ----------------------------------------------------------------------------- recipe and refusal

RECIPE = 'draft_vocab_size = 64\nepochs = 1\n[datasets]\nchat = 1.0\n'


@pytest.mark.parametrize("attention", ["llama", "mla"])
def test_recipes_with_the_switches_load_for_both_engines(attention, tmp_path):
    path = tmp_path / "r.toml"
    path.write_text(f'fc_norm = true\nnorm_output = true\nattention = "{attention}"\n' + RECIPE)
    shape = parse_recipe(path).shape
    assert shape.engines == ("sglang", "vllm")
    assert shape.layout() == {"norm_before_fc": False, "fc_norm": True, "norm_output": True}


@pytest.mark.parametrize("attention", ["llama", "mla"])
@pytest.mark.parametrize("switch", export_files.SWITCH_KEYS)
def test_an_engine_that_does_not_read_a_switch_is_refused_by_name(attention, switch, monkeypatch, tmp_path):
    monkeypatch.delitem(formats.for_(attention, "sglang").switch_readers, switch)  # as if SGLang did not read it
    path = tmp_path / "r.toml"
    path.write_text(f'{switch} = true\nattention = "{attention}"\n' + RECIPE)
    with pytest.raises(RecipeError, match=f"field '{switch}': cannot be served by sglang: .* does not read {switch}"):
        parse_recipe(path)
    DraftShape(draft_vocab_size=8, attention=attention, engines=["vllm"], **{switch: True})  # vLLM alone: served
    assert DraftShape(draft_vocab_size=8, attention=attention).layout()[switch] is False  # off: nothing to refuse


# ----------------------------------------------------------------------------- training


def test_training_with_the_switches_feeds_back_the_post_norm_state(tmp_path):
    model, vmap, head = tiny_drafter(fc_norm=True, norm_output=True)
    data = Batches([batch_of([12, 9, 5], head, vmap, seed=i) for i in range(4)])
    before = copy.deepcopy(model)
    run = train(TrainSettings(max_steps=6, ttt_steps=3, lr=3e-3), model, data, Teacher(head, vmap),
                tmp_path / "run", progress=False)
    assert run.final["loss"] < run.metrics[0]["loss"]
    for i in range(3):  # the per-layer norms trained
        assert not torch.equal(model.fc_norm[i].weight, before.fc_norm[i].weight)
    fed = []
    model.midlayer.register_forward_pre_hook(lambda _m, args: fed.append(args[1].detach().clone()))
    ids, aux = inputs(model, n=10)
    with torch.no_grad():
        model(ids, aux, ttt_steps=2)
        pre = model.step(ids[:, 1:], model.project_aux(aux[:, :-1]), torch.arange(9)[None], KVCache())
    # step 1 read norm(step 0's output), not the output itself
    torch.testing.assert_close(fed[1][:, :9], model.norm(pre), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(fed[1][:, :9], pre, atol=1e-2)


# ----------------------------------------------------------------------------- vocabulary map


def test_the_vocab_map_is_keyed_by_its_sizes_and_its_corpus(tmp_path):
    counts = torch.arange(300, 0, -1, dtype=torch.long)
    first = load_or_build_vocab_map(tmp_path, counts, 40)
    assert torch.equal(load_or_build_vocab_map(tmp_path, counts, 40).d2t, first.d2t)  # the same: reused
    wider = load_or_build_vocab_map(tmp_path, counts, 48)  # another draft_vocab_size: a new map, a new file
    assert wider.draft_vocab_size == 48 and wider.file_name() != first.file_name()
    other = counts.clone()
    other[-1] += 1000  # another corpus: the rarest token becomes the most common
    recounted = load_or_build_vocab_map(tmp_path, other, 40)
    assert recounted.source_hash != first.source_hash and bool(recounted.t2d[299]) and not bool(first.t2d[299])
    longer = torch.cat([counts, torch.zeros(20, dtype=torch.long)])  # another target vocabulary, same counts
    assert load_or_build_vocab_map(tmp_path, longer, 40).target_vocab_size == 320
    assert len(list(tmp_path.glob("vocab_map-*"))) == 4
