"""Recipe options of the trainer on a tiny synthetic drafter (no model needed, a few seconds).

- packed training (the real tokens back to back) gives the padded batch's loss terms and
  gradients, for every objective;
- each objective, feature noise, Muon and the schedules train, checkpoint and resume exactly;
- layouts an engine would run differently are refused when the recipe loads, naming the field;
  a norm-before-fc drafter round-trips through its vLLM export and SGLang's is refused.
"""

import copy
import json

import pytest
import torch

from eagle3_assets.drafter import formats
from eagle3_assets.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_assets.drafter.recipes import RecipeError, parse_recipe
from eagle3_assets.drafter.training.config import TrainSettings
from eagle3_assets.drafter.training.job import head_from_target
from eagle3_assets.drafter.training.loop import Trainer, train
from eagle3_assets.drafter.training.teacher import Teacher
from eagle3_assets.drafter.vocab_map import VocabMap

H, V, N = 32, 300, 64


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def tiny_drafter(seed: int = 1, **kw) -> tuple[Eagle3Drafter, VocabMap, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    cfg = DrafterConfig(hidden_size=H, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512, vocab_size=V,
                        draft_vocab_size=N, target_hidden_size=H, aux_layer_ids=[1, 2, 3], **kw)
    ids = torch.sort(torch.randperm(V, generator=g)[:N]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    vmap = VocabMap(d2t=ids - torch.arange(N), t2d=t2d, source_hash="synthetic")
    model = Eagle3Drafter(cfg).init_weights(seed).set_embeddings(torch.randn(V, H, generator=g)).set_vocab_map(vmap)
    return model, vmap, torch.randn(V, H, generator=g)


def batch_of(lengths, head, vmap, seed=0) -> dict:
    """A right-padded batch whose target mostly picks draft-vocabulary tokens."""
    g = torch.Generator().manual_seed(seed)
    b, t = len(lengths), max(lengths)
    batch = {"input_ids": torch.zeros(b, t, dtype=torch.long), "loss_mask": torch.zeros(b, t, dtype=torch.long),
             "attention_mask": torch.zeros(b, t, dtype=torch.long), "aux_hidden": torch.zeros(b, t, 3 * H),
             "last_hidden": torch.zeros(b, t, H)}
    draft_ids = vmap.target_ids
    for i, n in enumerate(lengths):
        ids = draft_ids[torch.randint(0, N, (n,), generator=g)]
        batch["input_ids"][i, :n] = ids
        batch["loss_mask"][i, n // 3: n] = 1
        batch["attention_mask"][i, :n] = 1
        batch["aux_hidden"][i, :n] = torch.randn(n, 3 * H, generator=g)
        batch["last_hidden"][i, :n] = head[ids.roll(-1)] * 2 + torch.randn(n, H, generator=g)
    return batch


class Batches:
    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def epoch(self, epoch, start=0):
        yield from self.batches[start:]


@pytest.mark.parametrize("loss", ["kl", "tv", "nla", "lk"])
def test_packed_training_equals_the_padded_batch(loss):
    model, vmap, head = tiny_drafter()
    teacher = Teacher(head, vmap)
    batch = batch_of([20, 7, 13, 3, 1], head, vmap)
    settings = TrainSettings(max_steps=1, ttt_steps=3, loss=loss, feature_noise=0.0)
    sums, grads = {}, {}
    for packed in (False, True):
        m = copy.deepcopy(model)
        terms = Trainer(settings, m, Batches([batch]), teacher, "unused", packed=packed).step_sums(batch)
        key = "kl" if loss == "lk" else loss
        sum(t[key] for t in terms).backward()
        sums[packed] = [{k: float(v.detach()) for k, v in t.items()} for t in terms]
        grads[packed] = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    assert sums[True][0]["positions"] > 0 and sums[True][2]["positions"] < sums[True][0]["positions"]
    for a, b in zip(sums[False], sums[True]):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)
    assert grads[True].keys() == grads[False].keys()
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("options", [
    {"loss": "lk", "feature_noise": 0.2},
    {"optimizer": "muon", "schedule": "linear", "min_lr_ratio": 0.1, "weight_decay": 0.01},
    {"loss": "tv", "warmup_steps": 2},
])
def test_options_train_and_resume_exactly(options, tmp_path):
    model, vmap, head = tiny_drafter()
    teacher = Teacher(head, vmap)
    data = Batches([batch_of([12, 9, 5], head, vmap, seed=i) for i in range(4)])
    settings = TrainSettings(max_steps=6, ttt_steps=2, lr=3e-3, checkpoint_every=3, **options)
    whole = copy.deepcopy(model)
    full = train(settings, whole, data, teacher, tmp_path / "whole", progress=False)
    first = train(settings, copy.deepcopy(model), data, teacher, tmp_path / "split", progress=False, stop_after=3)
    assert first.stopped_early and first.steps == 3
    resumed = copy.deepcopy(model)
    rest = train(settings, resumed, data, teacher, tmp_path / "split", progress=False)
    assert rest.steps == 6 and full.final["loss"] < full.metrics[0]["loss"]
    assert [m["loss"] for m in rest.metrics] == pytest.approx([m["loss"] for m in full.metrics], rel=1e-6)
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    with pytest.raises(ValueError, match="other settings"):
        other = settings.model_copy(update={"feature_noise": 0.5})
        train(other, copy.deepcopy(model), data, teacher, tmp_path / "split", progress=False)


def test_head_from_target_takes_the_target_rows_of_the_draft_vocabulary():
    model, vmap, head = tiny_drafter()
    head_from_target(model, head, torch.full((H,), 0.5))
    torch.testing.assert_close(model.lm_head.weight, head[vmap.target_ids])
    assert bool((model.norm.weight == 0.5).all())


def test_frozen_head_stays_the_targets_while_the_rest_trains(tmp_path):
    model, vmap, head = tiny_drafter()
    head_from_target(model, head, torch.full((H,), 0.5), freeze=True)
    start = copy.deepcopy(model.state_dict())
    data = Batches([batch_of([12, 9, 5], head, vmap, seed=i) for i in range(2)])
    settings = TrainSettings(max_steps=2, ttt_steps=2, lr=3e-3, init_head_from_target=True, freeze_head=True)
    train(settings, model, data, Teacher(head, vmap), tmp_path, progress=False)
    after = model.state_dict()
    for name in ("lm_head.weight", "norm.weight"):
        assert torch.equal(after[name], start[name]), name
    assert not torch.equal(after["fc.weight"], start["fc.weight"])


def test_schedules():
    cos = TrainSettings(max_steps=10, warmup_steps=2, min_lr_ratio=0.1)
    lin = cos.model_copy(update={"schedule": "linear"})
    assert [round(cos.lr_factor(i, 10), 4) for i in (0, 1, 2, 10)] == [0.5, 1.0, 1.0, 0.1]
    assert lin.lr_factor(6, 10) == pytest.approx(0.1 + 0.9 * 0.5)


RECIPE = "draft_vocab_size = 64\nepochs = 1\n[datasets]\ngeneral = 1.0\n"


@pytest.mark.parametrize("text, field", [
    ("norm_before_fc = true\n", "field 'norm_before_fc': cannot be served by sglang"),
    ('norm_before_fc = true\nengines = ["vllm"]\nattention = "mla"\n', "field 'norm_before_fc': is for the Llama-style"),
    ('engines = ["vllm", "vllm"]\n', "field 'engines'"),
    ('engines = ["trt"]\n', "field 'engines'"),
    ('loss = "mse"\n', "field 'loss'"),
    ('optimizer = "sgd"\n', "field 'optimizer'"),
    ("feature_noise = -0.1\n", "field 'feature_noise'"),
    ("min_lr_ratio = 2.0\n", "field 'min_lr_ratio'"),
    ("freeze_head = true\n", "field 'freeze_head': keeps the head as it starts"),
])
def test_recipe_refuses_bad_options_naming_the_field(text, field, tmp_path):
    path = tmp_path / "r.toml"
    path.write_text(text + RECIPE)
    with pytest.raises(RecipeError) as err:
        parse_recipe(path)
    assert str(path) in str(err.value) and field in str(err.value)


def test_norm_before_fc_is_served_by_vllm_alone(tmp_path):
    path = tmp_path / "vllm_only.toml"
    path.write_text('norm_before_fc = true\nengines = ["vllm"]\n' + RECIPE)
    recipe = parse_recipe(path)
    assert recipe.shape.norm_before_fc and recipe.shape.engines == ("vllm",)
    model, _, _ = tiny_drafter(norm_before_fc=True)
    with torch.no_grad():
        model.input_norm.weight.uniform_(0.5, 1.5)
    out = formats.export("vllm", model, tmp_path / "vllm", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["norm_before_fc"] is True and cfg["norm_before_residual"] is False
    assert formats.check("vllm", out) == []
    back = formats.load("vllm", out)
    torch.testing.assert_close(back.input_norm.weight, model.input_norm.weight)
    aux = torch.randn(2, 5, 3 * H)
    torch.testing.assert_close(back.project_aux(aux), model.project_aux(aux))
    with pytest.raises(ValueError, match="SGLang cannot serve"):
        formats.export("sglang", model, tmp_path / "sglang")
    plain, _, _ = tiny_drafter()
    sg = formats.export("sglang", plain, tmp_path / "sglang-plain", dtype="float32")
    assert formats.check("sglang", sg) == []


def test_target_ids_are_cached_per_sample_and_unchanged():
    """The second epoch reads the argmax from the cache: the same terms, no full-vocabulary matmul."""
    model, vmap, head = tiny_drafter()
    teacher = Teacher(head, vmap)
    batch = {**batch_of([9, 14, 4], head, vmap), "keys": ["a", "b", "c"]}
    trainer = Trainer(TrainSettings(max_steps=1, ttt_steps=2, feature_noise=0.0), model, Batches([batch]), teacher, "unused")
    first = [{k: float(v.detach()) for k, v in t.items()} for t in trainer.step_sums(batch)]
    assert set(trainer.target_ids.store) == {"a", "b", "c"}
    calls = []
    teacher.target_ids = lambda h: calls.append(h) or torch.zeros(h.shape[0], dtype=torch.long)
    again = [{k: float(v.detach()) for k, v in t.items()} for t in trainer.step_sums(batch)]
    assert not calls and again == first


# Kimi-K2.5's language model as its config.json `text_config` states it (DeepSeek-V3 shape).
K25_TEXT = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168,
            "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
            "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "max_position_embeddings": 262144, "rope_theta": 50000.0,
            "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}


def test_documented_kimi_k25_recipe_loads_and_shapes_a_k25_drafter():
    """docs/recipes/kimi-k2.5.toml validates, and on K2.5's config gives the EAGLE 3.1 MLA drafter both engines
    load (aux layers [1, 29, 57], the target's latent sizes) with a floor an untrained drafter fails."""
    from pathlib import Path

    recipe = parse_recipe(Path(__file__).resolve().parents[3] / "docs" / "recipes" / "kimi-k2.5.toml")
    cfg = DrafterConfig.from_target({"text_config": K25_TEXT}, draft_vocab_size=recipe.shape.draft_vocab_size,
                                    aux_layer_ids=recipe.shape.aux_layer_ids, attention=recipe.shape.attention,
                                    intermediate_size=recipe.shape.intermediate_size)
    assert cfg.aux_layer_ids == [1, 29, 57] and cfg.attention == "mla"
    assert (cfg.mla["kv_lora_rank"], cfg.mla["qk_rope_head_dim"]) == (512, 64)  # what vLLM's MLA kernels need
    assert (cfg.vocab_size, cfg.draft_vocab_size, cfg.intermediate_size) == (163840, 32000, 18432)
    assert recipe.training.ttt_steps == recipe.evaluation.speculative_k == 3
    assert (recipe.shape.fc_norm, recipe.shape.norm_output) == (True, True)  # EAGLE 3.1, the best two-engine row
    assert recipe.training.feature_noise > 0 and len(recipe.datasets) >= 2
    assert recipe.evaluation.acceptance_floor > 1.0  # an untrained drafter's acceptance length is 1.0
