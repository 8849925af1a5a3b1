"""A small EAGLE-3 drafter trained in about a minute on the embedded target's own answers.

Tests and benchmarks that need a drafter which beats chance (so acceptance figures mean
something) but cannot afford the whole graph use this: greedy answers to short questions,
features straight from the target, 40 training steps, draft vocab 512.
"""

from __future__ import annotations

from pathlib import Path

TRAIN_QUESTIONS = [f"What is {a}+{b}? Answer with a number only." for a, b in [(2, 3), (7, 5), (10, 4), (6, 9)]] + [
    "Name three colors.", "What is the capital of France?", "Say hello in Spanish.", "List two fruits.",
    "What is water made of?", "Name a large ocean.", "What color is the sky?", "Give me a synonym for happy.",
    "How many legs does a spider have?", "What is the opposite of cold?", "Name a planet.", "What do bees make?",
]
HELD_OUT = ["What is the capital of Italy?", "Name two animals.", "What is 5+6? Answer with a number only.",
            "What is the opposite of hot?", "Name a fruit that is yellow.", "How many days are in a week?",
            "What is 9+3? Answer with a number only.", "Say goodbye in French."]


def train_small_drafter(embedded, model_dir: Path, out_dir: Path, *, k: int = 3, layer_ids=(1, 14, 26),
                        steps: int = 40, export_dtype: str = "float32") -> Path:
    """Train on ``TRAIN_QUESTIONS`` and return the vLLM (speculators) export directory. float32 by
    default, so vLLM and the project's evaluator run the very same weights."""
    from eagle3_assets.drafter.export import export_vllm
    from eagle3_assets.drafter.model import DrafterConfig, build_drafter
    from eagle3_assets.drafter.spec_decode import target_features
    from eagle3_assets.drafter.target_weights import read_target_config, read_target_embeddings, read_target_lm_head
    from eagle3_assets.drafter.training.config import TrainSettings
    from eagle3_assets.drafter.training.data import ShardBatches, ShardDataset
    from eagle3_assets.drafter.training.loop import train
    from eagle3_assets.drafter.training.teacher import Teacher
    from eagle3_assets.drafter.vocab_map import build_vocab_map
    from eagle3_assets.hidden_states.write import write_samples

    out_dir = Path(out_dir)
    prompts = [embedded.render_prompt([{"role": "user", "content": q}]) for q in TRAIN_QUESTIONS]
    gens = embedded.generate(prompts, max_new_tokens=24)
    seqs = [p + g.output_ids for p, g in zip(prompts, gens)]
    masks = [[0] * len(p) + [1] * len(g.output_ids) for p, g in zip(prompts, gens)]
    feats = target_features(embedded.model, seqs, masks, list(layer_ids))
    cfg = read_target_config(model_dir)
    # stored as the hidden_states asset stores them, then streamed back as training does
    write_samples(out_dir / "features", feats, layer_ids=list(layer_ids), num_layers=cfg["num_hidden_layers"],
                  target={"name": Path(model_dir).name, "id": "small-drafter"})
    dataset = ShardDataset({out_dir / "features": 1.0}, max_length=64)
    vmap = build_vocab_map(dataset.token_counts(cfg["vocab_size"]), 512)
    teacher = Teacher(read_target_lm_head(model_dir).float(), vmap)
    dcfg = DrafterConfig.from_target(cfg, draft_vocab_size=512, intermediate_size=256)
    model = build_drafter(dcfg, read_target_embeddings(model_dir), vmap, seed=0)
    settings = TrainSettings(max_steps=steps, batch_size=4, ttt_steps=k, lr=3e-3, warmup_steps=3,
                             checkpoint_every=steps, max_length=64)
    train(settings, model, ShardBatches(dataset, 4, seed=0), teacher, out_dir / "train", progress=False)
    dataset.close()
    return export_vllm(model.eval(), out_dir / "vllm", dtype=export_dtype, verifier=str(model_dir), speculative_tokens=k)
