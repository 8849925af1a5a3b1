"""Drafter kinds are a registry (``drafter/kinds``), and their exports another (``drafter/formats``,
one format per kind and engine): a kind registered there and nowhere else, with its formats, is
accepted by the recipe's shape, builds the model with its attention, and reaches every export
entry point (write, read back, check) through the formats registry; a name not registered is
refused with the registered ones listed. The fake formats write their own layout, so the files on
disk say which exporter ran, and their loader's weights are compared with the model that was exported."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from pydantic import ValidationError

from eagle3_assets.drafter import formats, kinds
from eagle3_assets.drafter.export_files import DTYPES, export_weights, rebuild_drafter, write_dir_atomic
from eagle3_assets.drafter.model import Attention, DrafterConfig, build_drafter
from eagle3_assets.drafter.training.config import DraftShape
from eagle3_assets.drafter.vocab_map import build_vocab_map

TARGET = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 120, "hidden_size": 32,
          "intermediate_size": 48, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
          "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 256, "rope_theta": 10000.0}
FAKE_ARCH = "FakeEagle3ForCausalLM"


class FakeAttention(Attention):
    """A kind's own attention class (Llama's maths under another class, enough to tell it apart)."""


def _fake_format(engine: str, calls: list) -> formats.ServingFormat:
    def export(model, out_dir, *, dtype="bfloat16", **options):
        calls.append(("export", engine, dict(options)))
        cfg = {"architectures": [FAKE_ARCH], "engine": engine, "drafter": model.config.to_dict(), "torch_dtype": dtype}
        return write_dir_atomic(out_dir, {"config.json": cfg, "model.safetensors": export_weights(model, DTYPES[dtype])})

    def load(export_dir, embeddings):
        from safetensors.torch import load_file

        calls.append(("load", engine))
        cfg = json.loads((export_dir / "config.json").read_text())
        return rebuild_drafter(DrafterConfig.from_dict(cfg["drafter"]), load_file(str(export_dir / "model.safetensors")),
                               embeddings)

    def check(export_dir):
        calls.append(("check", engine))
        cfg = json.loads((export_dir / "config.json").read_text())
        return [] if cfg["engine"] == engine else [f"written for {cfg['engine']}, not {engine}"]

    return formats.ServingFormat(kind="fake", engine=engine, export=export, load=load, check=check,
                                 recognises=lambda config: config.get("architectures") == [FAKE_ARCH],
                                 aux_ids=lambda config: config["drafter"]["aux_layer_ids"],
                                 switch_readers={"fc_norm": "fake.reader"},
                                 target_notes=lambda target_config: [f"a fake note for {engine}"])


def _fake_kind() -> kinds.DrafterKind:
    def layout_problems(shape):
        return {"norm_before_fc": "is not in the fake kind's layout"} if shape.norm_before_fc else {}

    return kinds.DrafterKind(name="fake", attention=FakeAttention, target_shape=None, layout_problems=layout_problems,
                             target_notes=lambda target_config: ["a fake note"])


@pytest.fixture
def fake_kind(monkeypatch):
    """The fake kind in a module of its own, registered by one line in KINDS, and its two serving formats,
    a module each registered by one line in FORMATS (as a real kind and its formats are)."""
    calls: list = []
    module = types.ModuleType("fake_drafter_kind")
    module.KIND = _fake_kind()
    monkeypatch.setitem(sys.modules, "fake_drafter_kind", module)
    monkeypatch.setitem(kinds.KINDS, "fake", "fake_drafter_kind:KIND")
    for engine in formats.serving_engines():
        module = types.ModuleType(f"fake_{engine}_format")
        module.FORMAT = _fake_format(engine, calls)
        monkeypatch.setitem(sys.modules, f"fake_{engine}_format", module)
        monkeypatch.setitem(formats.FORMATS, ("fake", engine), f"fake_{engine}_format:FORMAT")
    return calls


def test_the_registered_kinds_resolve_to_themselves():
    assert kinds.kind_names() == ("llama", "mla")
    for name in kinds.kind_names():
        kind = kinds.get_kind(name)
        assert isinstance(kind, kinds.DrafterKind) and kind.name == name
    with pytest.raises(ValueError, match=r"unknown drafter kind 'fake'; the registered kinds are \['llama', 'mla'\]"):
        kinds.get_kind("fake")


def test_the_recipe_shape_accepts_exactly_the_registered_kinds(fake_kind, monkeypatch):
    assert DraftShape(draft_vocab_size=8, attention="fake").attention == "fake"
    with pytest.raises(ValidationError, match=r"unknown drafter kind 'nosuch'; expected one of \['fake', 'llama', 'mla'\]"):
        DraftShape(draft_vocab_size=8, attention="nosuch")
    with pytest.raises(ValidationError, match="'norm_before_fc' is not in the fake kind's layout"):
        DraftShape(draft_vocab_size=8, attention="fake", norm_before_fc=True, engines=["vllm"])
    assert formats.target_notes("fake", TARGET) == ["a fake note", "a fake note for sglang", "a fake note for vllm"]
    with pytest.raises(ValidationError, match="'norm_output' cannot be served by sglang, vllm"):
        DraftShape(draft_vocab_size=8, attention="fake", norm_output=True)  # no format reads it
    assert DraftShape(draft_vocab_size=8, attention="fake", fc_norm=True).fc_norm  # both formats read it
    monkeypatch.delitem(kinds.KINDS, "fake")
    with pytest.raises(ValidationError, match="unknown drafter kind 'fake'"):
        DraftShape(draft_vocab_size=8, attention="fake")


def test_a_fake_kind_reaches_the_model_and_every_export_entry_point(fake_kind, tmp_path):
    cfg = DrafterConfig.from_target(TARGET, draft_vocab_size=16, attention="fake")
    assert cfg.mla is None
    embeddings = torch.randn(120, 32, generator=torch.Generator().manual_seed(0))
    model = build_drafter(cfg, embeddings, build_vocab_map(torch.arange(120, 0, -1), 16), seed=1).eval()
    assert type(model.midlayer.self_attn) is FakeAttention

    sglang = formats.export("sglang", model, tmp_path / "sglang", dtype="float32")
    vllm = formats.export("vllm", model, tmp_path / "vllm", dtype="float32", verifier="/v", speculative_tokens=5)
    assert json.loads((sglang / "config.json").read_text())["architectures"] == [FAKE_ARCH]
    assert json.loads((vllm / "config.json").read_text())["engine"] == "vllm"
    assert fake_kind[:2] == [("export", "sglang", {}),
                             ("export", "vllm", {"verifier": "/v", "speculative_tokens": 5})]

    loaded = formats.load("sglang", sglang, embeddings)
    assert fake_kind[-1] == ("load", "sglang") and type(loaded.midlayer.self_attn) is FakeAttention
    original = model.state_dict()
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, original[name].to(value.dtype)), name
    formats.load("vllm", vllm, embeddings)
    assert fake_kind[-1] == ("load", "vllm")

    assert formats.check("sglang", sglang) == [] and formats.check("vllm", vllm) == []
    assert formats.check("vllm", sglang) == ["written for sglang, not vllm"]
    assert [c for c in fake_kind if c[0] == "check"] == [("check", "sglang"), ("check", "vllm"), ("check", "vllm")]


def test_an_export_no_kind_recognises_is_judged_by_the_default_kind(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["SomethingElse"]}))
    for engine in formats.serving_engines():
        assert formats.of_export({"architectures": ["SomethingElse"]}, engine).kind == kinds.DEFAULT_KIND
    with pytest.raises(ValueError, match="not a one-layer LlamaForCausalLMEagle3 export"):
        formats.load("sglang", tmp_path, torch.zeros(1, 1))


def test_the_architecture_page_names_the_files_a_new_kind_touches():
    """docs/architecture.md's steps for a new drafter kind name files and registry entries that exist."""
    import re

    from eagle3_assets.paths import REPO_ROOT

    text = (REPO_ROOT / "docs" / "architecture.md").read_text()
    step = text[text.index("- **A new drafter kind**"):]
    step = step[:step.index("\n- **", 1)]
    paths = set(re.findall(r"`((?:drafter|kinds)/[\w/.]*)`", step))
    assert {"kinds/llama.py", "kinds/mla/", "drafter/kinds/__init__.py", "drafter/formats/__init__.py"} <= paths
    for path in paths:
        assert (REPO_ROOT / "eagle3_assets" / ("drafter/" + path if path.startswith("kinds/") else path)).exists(), path
    for field in kinds.DrafterKind.__dataclass_fields__:  # every part of a kind is named in the step
        assert field in ("name", "attention") or f"`{field}`" in step, field
    assert "`KINDS`" in step and "`DrafterKind`" in step


def test_the_architecture_page_names_every_part_of_a_serving_format():
    """docs/architecture.md's step for a new serving format names the registry line and every field."""
    from eagle3_assets.paths import REPO_ROOT

    text = (REPO_ROOT / "docs" / "architecture.md").read_text()
    step = text[text.index("- **A new serving format**"):]
    step = step[:step.index("\n- **", 1)]
    assert "`FORMATS`" in step and "`ServingFormat`" in step and "drafter/formats/__init__.py" in step
    for field in formats.ServingFormat.__dataclass_fields__:
        assert field in ("kind", "engine") or f"`{field}`" in step, field
    for kind, engine in formats.FORMATS:  # every registered format is the module the step says
        assert (REPO_ROOT / "eagle3_assets" / "drafter" / "formats" / f"{kind}_{engine}.py").exists()
