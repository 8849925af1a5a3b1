"""Kimi-K2.5 contracts the kimi-mini target exposed, each pinned by a test that failed before its fix.

Tokenizer-level tests use the kimi-mini tokenizer alone (Kimi's real ids 163584..163839, its
encode semantics and K2.5's template rules); config-level tests use K2.5's own text config.
"""

import json
from types import SimpleNamespace

import pytest
import torch

from eagle3_assets.drafter import formats
from eagle3_assets.drafter.formats.llama_layout import export_rope_problems
from eagle3_assets.drafter.model import DrafterConfig, build_drafter
from eagle3_assets.drafter.rope import rope_frequencies
from eagle3_assets.target import layers as hidden_layers
from eagle3_assets.target.tokenizer import TargetTokenizer
from eagle3_assets.tokens.rows import build_token_row
from tests.support.kimi_tokenizer import build_kimi_test_tokenizer

IM_END, EOS, THINK, THINK_END = 163586, 163585, 163606, 163607

# Kimi-K2.5's language-model config (text_config of the released checkpoint), the keys stages read.
K25_TEXT = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
    "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 384, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 1, "rms_norm_eps": 1e-05, "max_position_embeddings": 262144,
    "rope_theta": 50000.0, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "eos_token_id": 163585, "tie_word_embeddings": False,
}
K25 = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": K25_TEXT,
       "eos_token_id": 163585, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    return build_kimi_test_tokenizer(tmp_path_factory.mktemp("kimi") / "Kimi-Mini-Tokenizer")


@pytest.fixture(scope="module")
def kimi(kimi_dir):
    return TargetTokenizer.load(kimi_dir, trust_remote_code=True)  # no end_of_turn configured


def row(**kw):
    base = {"sample_id": "s", "dataset": "d", "prompt_id": "p", "source": "sglang", "prompt_ids": None,
            "output_ids": None, "text": "", "reasoning": None, "finish_reason": "stop"}
    return {**base, **kw}


# --- end of turn -------------------------------------------------------------------------------

def test_default_end_of_turn_comes_from_the_chat_template_not_eos_token(kimi):
    assert kimi.tokenizer.eos_token == "[EOS]" and kimi.tokenizer.eos_token_id == EOS
    assert (kimi.end_of_turn, kimi.end_of_turn_id) == ("<|im_end|>", IM_END)


# --- SGLang thinking rows ------------------------------------------------------------------------

@pytest.mark.parametrize("parser", [False, True], ids=["no-reasoning-parser", "reasoning-parser"])
def test_sglang_thinking_rows_calibrate_exactly(kimi, parser):
    prompt = kimi.render_prompt([{"role": "user", "content": "What is 2+3?"}])
    assert prompt[-1] == THINK  # K2.5: generation starts inside the think block
    native = kimi.encode_text("Add 2 and 3.") + [THINK_END] + kimi.encode_text("It is 5.") + [IM_END]
    if parser:  # reasoning separated by the server's parser, the answer alone in text
        r = row(prompt_ids=prompt, output_ids=native, text="It is 5.", reasoning="Add 2 and 3.")
    else:  # SGLang's text is the decode of its ids: reasoning</think>answer, reasoning None
        r = row(prompt_ids=prompt, output_ids=native, text="Add 2 and 3.</think>It is 5.")
    t = build_token_row(r, None, kimi)
    assert t["retok_exact"], t["retok_diff"]
    assert t["input_ids"][t["prompt_len"]:].count(THINK_END) == 1


def test_sglang_thinking_row_cut_inside_the_think_block(kimi):
    prompt = kimi.render_prompt([{"role": "user", "content": "Think long."}])
    native = kimi.encode_text("Let me think about it")
    t = build_token_row(row(prompt_ids=prompt, output_ids=native, text="Let me think about it", finish_reason="length"),
                        None, kimi)
    assert t["retok_exact"] and "think block never closed" in t["build_notes"]


def test_stop_token_kept_in_text_is_not_counted_twice(kimi):
    prompt = kimi.render_prompt([{"role": "user", "content": "Hi"}])
    native = kimi.encode_text("Done.") + [THINK_END] + kimi.encode_text("Hello") + [IM_END]
    t = build_token_row(row(prompt_ids=prompt, output_ids=native, text="Done.</think>Hello<|im_end|>"), None, kimi)
    assert t["retok_exact"] and "stop token trimmed" in t["build_notes"]


# --- SGLang text options -------------------------------------------------------------------------

def test_sglang_text_options_are_sent_and_shape_the_text(kimi):
    from eagle3_assets.engines.http.samples import SampleRequest, SamplingSettings
    from eagle3_assets.engines.sglang.backend import sglang_backend
    from eagle3_assets.loopback.generators import ModelGenerator, Output
    from eagle3_assets.loopback.sglang_app import SGLangApp
    from eagle3_assets.resources import SGLangResource

    req = SampleRequest(sample_id="s1", dataset="d", prompt_id="p", sample_index=0,
                        messages=[{"role": "user", "content": "Hi"}])
    sampling = SamplingSettings(target="t")
    default = sglang_backend(SGLangResource(), kimi.render_prompt).prepare(req, max_tokens=8, sampling=sampling)
    sp = default.payload["sampling_params"]
    assert (sp["skip_special_tokens"], sp["spaces_between_special_tokens"], sp["no_stop_trim"]) == (False, False, False)
    custom = sglang_backend(SGLangResource(skip_special_tokens=True, no_stop_trim=True), kimi.render_prompt)
    assert custom.prepare(req, max_tokens=8, sampling=sampling).payload["sampling_params"]["no_stop_trim"] is True
    # the loopback detokenizes as SGLang does with the options it is sent
    gen = SimpleNamespace(decode_with=lambda ids, **kw: ModelGenerator.decode_with(
        SimpleNamespace(model=SimpleNamespace(tokenizer=kimi.tokenizer)), ids, **kw))
    app = SGLangApp.__new__(SGLangApp)
    app.gen = gen
    ids = kimi.encode_text("Add.") + [THINK_END] + kimi.encode_text("It is 5.") + [IM_END]
    out = Output(ids, "stop", "", len(default.prompt_ids))
    prompt = default.prompt_ids
    faithful = build_token_row(row(prompt_ids=prompt, output_ids=ids, text=app.text_of(out, sp)), None, kimi)
    assert faithful["retok_exact"]
    sglang_defaults = app.text_of(out, {})  # skip_special_tokens and spaces_between_special_tokens on
    assert sglang_defaults == "Add. </think> It is 5."
    drifted = build_token_row(row(prompt_ids=prompt, output_ids=ids, text=sglang_defaults), None, kimi)
    assert not drifted["retok_exact"]


# --- template fidelity ---------------------------------------------------------------------------

# SpecForge's reference tokenization of this conversation by the real Kimi-K2-Thinking tokenizer
# (sgl-project/SpecForge tests/test_data/test_references/kimi-k2-thinking_standard_ref.json).
SPECFORGE_K2_THINKING = [
    163594, 14062, 163601, 3900, 554, 261, 13205, 26626, 13, 163586, 163587, 2482, 163601, 24328, 554, 398, 30, 163586,
    163588, 69702, 163601, 163606, 163607, 6725, 1530, 387, 1999, 33249, 17, 13, 163586, 163587, 2482, 163601, 6034,
    3410, 554, 398, 30, 163586, 163588, 69702, 163601, 1228, 2285, 3410, 13, 163586]
STANDARD = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Who are you?"},
            {"role": "assistant", "content": "My name is Qwen2."}, {"role": "user", "content": "How old are you?"},
            {"role": "assistant", "content": "11 years old."}]


def skeleton(ids):
    """Special and marker ids kept, each run of ordinary text ids collapsed to one 'T'."""
    out = []
    for i in ids:
        if i >= 163584:
            out.append(i)
        elif not out or out[-1] != "T":
            out.append("T")
    return out


def test_template_matches_the_special_token_structure_of_kimi_reference_ids(kimi):
    ours = kimi.tokenizer.apply_chat_template(STANDARD, tokenize=True, add_generation_prompt=False, return_dict=True)
    ref = skeleton(SPECFORGE_K2_THINKING)
    mine = skeleton(list(ours["input_ids"]))
    # identical up to the final answer (history answer with its empty think pair included); K2.5
    # makes the finished final answer history too, so it also gets the empty think pair that
    # K2-Thinking's template leaves out there
    assert mine[:-5] == ref[:-3]
    assert ref[-3:] == [163601, "T", IM_END] and mine[-5:] == [163601, THINK, THINK_END, "T", IM_END]
    text = kimi.tokenizer.apply_chat_template(STANDARD, tokenize=False, add_generation_prompt=False)
    assert text.startswith("<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|><|im_user|>user")


def test_template_rules_tools_names_ids_history(kimi):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "Weather?", "name": "alice"},
            {"role": "assistant", "content": "", "reasoning_content": "need a tool",
             "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}]
    text = kimi.tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    # K2.5's override: the tools as a TypeScript namespace (tools_ts_str), not JSON
    assert text.startswith("<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\nnamespace functions {\n"
                           "type get_weather = (_: {}) => any;\n}\n<|im_end|>")
    assert "<|im_user|>alice<|im_middle|>Weather?<|im_end|>" in text  # role name from `name`
    # a tool-call turn after the last plain answer keeps its reasoning; the id is written verbatim
    assert ("<|im_assistant|>assistant<|im_middle|><think>need a tool</think><|tool_calls_section_begin|>"
            '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
            "<|tool_calls_section_end|><|im_end|>") in text
    assert "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>" in text
    assert text.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    off = kimi.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, thinking=False)
    assert off.endswith("<think></think>") and "<think>need a tool</think>" not in off


# --- aux layer ids -------------------------------------------------------------------------------

def test_kimi_default_aux_layers_and_the_sglang_shift_guard():
    assert hidden_layers.default_layer_ids(61) == [1, 29, 57]
    assert hidden_layers.resolve_layer_ids(61, [1, 20, 40]) == [1, 20, 40]
    with pytest.raises(ValueError, match="do not start at 1"):
        hidden_layers.resolve_layer_ids(61, [2, 29, 57])


# --- drafter: config, rope, exports --------------------------------------------------------------

def test_drafter_config_from_kimi_k25_carries_its_yarn_rope():
    cfg = DrafterConfig.from_target(K25, draft_vocab_size=32000, intermediate_size=12288)
    assert cfg.aux_layer_ids == [1, 29, 57] and cfg.vocab_size == 163840 and cfg.hidden_size == 7168
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 64, 128)  # v_head_dim wide
    assert cfg.rope_theta == 50000.0 and cfg.max_position_embeddings == 262144
    assert cfg.rope_scaling == {"rope_type": "yarn", "type": "yarn", "factor": 64.0,
                                "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}


def test_drafter_rope_is_what_transformers_reads_from_the_export(tmp_path):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    small = json.loads(json.dumps(K25))
    small["text_config"].update(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, v_head_dim=16,
                                intermediate_size=32, vocab_size=300, num_hidden_layers=7)
    cfg = DrafterConfig.from_target(small, draft_vocab_size=16)
    model = build_drafter(cfg, torch.randn(300, 64))
    out = formats.export("sglang", model, tmp_path / "sglang", dtype="float32")
    exported = json.loads((out / "config.json").read_text())
    hf = LlamaConfig(**{k: v for k, v in exported.items() if k not in ("architectures", "eagle_config")})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    ours, our_factor = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert torch.allclose(inv_freq, ours) and factor == pytest.approx(our_factor) == pytest.approx(1.4158883)
    assert formats.check("sglang", out) == []
    assert formats.check("vllm", formats.export("vllm", model, tmp_path / "vllm", dtype="float32")) == []


def test_export_checks_refuse_what_an_engine_would_misread(tmp_path):
    raw = {"rope_theta": 50000.0, "rope_scaling": dict(K25_TEXT["rope_scaling"])}
    problems = export_rope_problems(raw)
    assert any("mscale" in p and "transformers applies" in p for p in problems)
    assert any("rope_type" in p for p in problems)
    small = json.loads(json.dumps(K25))
    small["text_config"].update(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, v_head_dim=16,
                                intermediate_size=32, vocab_size=300, num_hidden_layers=7)
    model = build_drafter(DrafterConfig.from_target(small, draft_vocab_size=16), torch.randn(300, 64))
    out = formats.export("sglang", model, tmp_path / "sglang", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 3, 4]
    cfg["rope_scaling"]["mscale"] = 1.0
    (out / "config.json").write_text(json.dumps(cfg))
    problems = formats.check("sglang", out)
    assert any("do not start at 1" in p for p in problems) and any("mscale" in p for p in problems)


def test_kimi_mini_checkpoint_is_laid_out_like_k25(kimi_mini_dir):
    from safetensors import safe_open

    from eagle3_assets.drafter.target_weights import read_target_embeddings, read_target_lm_head
    from eagle3_assets.target.spec import TargetSpec

    with safe_open(str(kimi_mini_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "language_model.model.embed_tokens.weight" in names and "language_model.lm_head.weight" in names
    assert "language_model.model.layers.1.mlp.experts.0.gate_proj.weight" in names
    assert any(n.startswith("vision_tower.") for n in names) and not any(n.startswith("model.") and "layers" in n
                                                                          for n in names)
    assert tuple(read_target_embeddings(kimi_mini_dir).shape) == (163840, 64)
    assert tuple(read_target_lm_head(kimi_mini_dir).shape) == (163840, 64)
    spec = TargetSpec(kimi_mini_dir, trust_remote_code=True)
    text = spec.text_config
    assert spec.config["model_type"] == "kimi_k25" and text["num_hidden_layers"] == 7
    assert text["rope_scaling"]["type"] == "yarn" and text["first_k_dense_replace"] == 1
    assert (text["kv_lora_rank"], text["qk_rope_head_dim"]) == (512, 64)  # K2.5's latent: vLLM's CPU MLA kernel
    assert spec.load_tokenizer().end_of_turn_id == IM_END


def test_kimi_mini_ships_k25s_processor_files(kimi_mini_dir):
    """The files an engine reads at start (vLLM's K2.5 class builds its image processor from them):
    K2.5's preprocessor_config.json layout, and remote-code classes under K2.5's names that load."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoProcessor

    cfg = json.loads((kimi_mini_dir / "preprocessor_config.json").read_text())
    assert set(cfg) == {"auto_map", "media_proc_cfg"} and cfg["media_proc_cfg"]["patch_size"] == 14
    images = AutoImageProcessor.from_pretrained(kimi_mini_dir, trust_remote_code=True)
    assert type(images).__name__ == "KimiK25VisionProcessor" and images.num_frames_per_chunk == 4
    image = Image.new("RGB", (60, 30))  # 60x30 -> padded to 84x56: 3 x 2 merged 28-pixel blocks
    assert images.media_tokens_calculator({"type": "image", "image": image}) == 6
    out = images.preprocess([{"type": "image", "image": image}])
    assert out["grid_thws"].tolist() == [[1, 4, 6]] and tuple(out["pixel_values"].shape) == (24, 3, 14, 14)
    proc = AutoProcessor.from_pretrained(kimi_mini_dir, trust_remote_code=True)
    ids = proc(text="look <|media_pad|>", medias=[{"type": "image", "image": image}])["input_ids"]
    assert ids.count(163605) == 6  # <|media_pad|> widened to the image's token count


@pytest.mark.model
def test_kimi_mini_thinking_rows_over_sglang_http_calibrate(kimi_mini_dir):
    """Real HTTP: the SGLang loopback serving kimi-mini (thinking prompt, text as SGLang decodes it
    with the resource's text options), parsed by the backend, rebuilt by token_ids."""
    import httpx

    from eagle3_assets.engines.http.samples import SampleRequest, SamplingSettings
    from eagle3_assets.engines.sglang.backend import sglang_backend
    from eagle3_assets.loopback import ModelGenerator, SGLangApp, serve_in_thread
    from eagle3_assets.resources import SGLangResource
    from eagle3_assets.target.embedded import EmbeddedModel
    from eagle3_assets.tokens.rows import token_agreement

    tok = TargetTokenizer.load(kimi_mini_dir, trust_remote_code=True)
    with serve_in_thread(SGLangApp(ModelGenerator(EmbeddedModel(kimi_mini_dir, tokenizer=tok)))) as srv:
        backend = sglang_backend(SGLangResource(base_urls=[srv.url]), tok.render_prompt)
        for i, q in enumerate(["What is 2+3?", "Name a color."]):
            req = SampleRequest(sample_id=f"s{i}", dataset="d", prompt_id=f"p{i}", sample_index=0,
                                messages=[{"role": "user", "content": q}])
            prep = backend.prepare(req, max_tokens=16, sampling=SamplingSettings(target="t"))
            path, body = backend.request(prep, 1)
            r = httpx.post(srv.url + path, content=body, timeout=None)
            row = backend.parse(prep, r.status_code, r.headers, r.content, latency_s=0.0, attempts=1,
                                base_url=srv.url).row
            t = build_token_row(row, None, tok)
            native, retok = row["output_ids"], t["input_ids"][t["prompt_len"]:]
            text, finish, kw = _rebuilt_args(tok, row)
            rebuilt = tok.retokenize_completion(text, finish, **kw)
            assert retok == native and rebuilt.count(THINK_END) == native.count(THINK_END)
            matched, total = token_agreement(native, rebuilt)
            assert matched / total >= 0.9, t["retok_diff"]


def _rebuilt_args(tok, row):
    reasoning, text, closed = tok.split_thinking(row, row["prompt_ids"])
    return text, row["finish_reason"], {"reasoning": reasoning, "prompt_ids": row["prompt_ids"],
                                        "think_closed": closed}
