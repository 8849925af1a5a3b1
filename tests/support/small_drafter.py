"""A small EAGLE-3 drafter trained in about a minute on the embedded target's own answers.

Tests and benchmarks that need a drafter which beats chance (so acceptance figures mean
something) but cannot afford the whole graph use this: greedy answers to short questions,
features straight from the target, 40 training steps, draft vocab 512.
"""

from __future__ import annotations

from pathlib import Path

from eagle3_assets.target.config import read_config, text_config

TRAIN_QUESTIONS = [f"What is {a}+{b}? Answer with a number only." for a, b in [(2, 3), (7, 5), (10, 4), (6, 9)]] + [
    "Name three colors.", "What is the capital of France?", "Say hello in Spanish.", "List two fruits.",
    "What is water made of?", "Name a large ocean.", "What color is the sky?", "Give me a synonym for happy.",
    "How many legs does a spider have?", "What is the opposite of cold?", "Name a planet.", "What do bees make?",
]
HELD_OUT = ["What is the capital of Italy?", "Name two animals.", "What is 5+6? Answer with a number only.",
            "What is the opposite of hot?", "Name a fruit that is yellow.", "How many days are in a week?",
            "What is 9+3? Answer with a number only.", "Say goodbye in French."]


def train_small_drafter(embedded, model_dir: Path, out_dir: Path, *, k: int = 3, layer_ids=None,
                        steps: int = 40, export_dtype: str = "float32", attention: str = "llama",
                        questions: list[str] | None = None, max_new_tokens: int = 24, features: Path | None = None,
                        **switches: bool) -> Path:
    """Train on ``questions`` (default ``TRAIN_QUESTIONS``) and return the vLLM export directory
    (speculators format, or vLLM's MLA layout for ``attention="mla"``). float32 by default, so vLLM
    and the project's evaluator run the very same weights; aux layers default to the target's.
    ``features``: a shard directory of ``answer_features`` to reuse; ``switches``: EAGLE 3.1's
    ``fc_norm``/``norm_output``."""
    features = features or answer_features(embedded, model_dir, Path(out_dir) / "features", questions or TRAIN_QUESTIONS,
                               layer_ids=layer_ids, max_new_tokens=max_new_tokens)
    model = train_on_features(features, model_dir, Path(out_dir) / "train", k=k, steps=steps, attention=attention,
                              **switches)
    return export_vllm_float(model, model_dir, Path(out_dir) / "vllm", k=k, dtype=export_dtype)


def answer_features(embedded, model_dir: Path, out_dir: Path, questions: list[str], *, layer_ids=None,
                    max_new_tokens: int = 24, split: str = "train") -> Path:
    """The target's greedy answers to ``questions`` and their features, stored as the
    ``hidden_states`` asset stores them (a shard directory training streams from), as ``split``
    samples (``eval``: the held-out samples the trainer's acceptance estimate scores)."""
    from eagle3_assets.drafter.spec_decode import target_features
    from eagle3_assets.hidden_states.write import write_samples
    from eagle3_assets.target.layers import resolve_layer_ids

    text = _text_config(model_dir)
    layer_ids = resolve_layer_ids(text["num_hidden_layers"], list(layer_ids) if layer_ids else None)
    prompts = [embedded.render_prompt([{"role": "user", "content": q}]) for q in questions]
    gens = embedded.generate(prompts, max_new_tokens=max_new_tokens)
    seqs = [p + g.output_ids for p, g in zip(prompts, gens)]
    masks = [[0] * len(p) + [1] * len(g.output_ids) for p, g in zip(prompts, gens)]
    feats = target_features(embedded.model, seqs, masks, layer_ids)
    write_samples(out_dir, feats, layer_ids=layer_ids, num_layers=text["num_hidden_layers"],
                  target={"name": Path(model_dir).name, "id": "small-drafter"}, split=split,
                  id_prefix="s" if split == "train" else "e")  # the teacher caches by sample id: none shared
    return Path(out_dir)


def train_on_features(features: Path, model_dir: Path, out_dir: Path, *, k: int = 3, steps: int = 40,
                      attention: str = "llama", draft_vocab_size: int = 512, intermediate_size: int = 256,
                      lr: float = 3e-3, max_length: int = 64, eval_features: Path | None = None,
                      checkpoint_every: int | None = None, seed: int = 0, **switches: bool):
    """A drafter of ``attention`` kind (with EAGLE 3.1's ``switches``) trained by the project's trainer
    on a shard directory. With ``eval_features`` (a shard directory of ``eval`` samples) the trainer
    scores its acceptance estimate at chain length ``k`` at each checkpoint (every ``checkpoint_every``
    steps, default: the last only), and keeps every checkpoint under ``out_dir/checkpoints``. ``seed``:
    the drafter's initialisation, the batch order and the trainer's own draws."""
    from eagle3_assets.drafter.model import DrafterConfig, build_drafter
    from eagle3_assets.drafter.target_weights import read_target_embeddings, read_target_lm_head
    from eagle3_assets.drafter.training.config import TrainSettings
    from eagle3_assets.drafter.training.data import ShardBatches, ShardDataset, eval_split
    from eagle3_assets.drafter.training.loop import train
    from eagle3_assets.drafter.training.teacher import Teacher
    from eagle3_assets.drafter.vocab_map import build_vocab_map

    dataset = ShardDataset({Path(features): 1.0}, max_length=max_length)
    vmap = build_vocab_map(dataset.token_counts(_text_config(model_dir)["vocab_size"]), draft_vocab_size)
    teacher = Teacher(read_target_lm_head(model_dir).float(), vmap)
    dcfg = DrafterConfig.from_target(read_config(model_dir), draft_vocab_size=draft_vocab_size,
                                     intermediate_size=intermediate_size, attention=attention,
                                     aux_layer_ids=dataset.aux_layer_ids, **switches)
    model = build_drafter(dcfg, read_target_embeddings(model_dir), vmap, seed=seed)
    every = checkpoint_every or steps
    settings = TrainSettings(max_steps=steps, batch_size=4, ttt_steps=k, lr=lr, warmup_steps=3,
                             checkpoint_every=every, keep_checkpoints=-(-steps // every), max_length=max_length,
                             seed=seed)
    held_out = eval_split({Path(eval_features): 1.0}, max_length=max_length,
                          samples=settings.eal_samples) if eval_features else None
    train(settings, model, ShardBatches(dataset, 4, seed=seed), teacher, Path(out_dir), progress=False,
          eval_data=ShardBatches(held_out, 4, seed=0, shuffle=False) if held_out else None, eal_k=k)
    dataset.close()
    return model.eval()


def export_vllm_float(model, model_dir: Path, out_dir: Path, *, k: int = 3, dtype: str = "float32") -> Path:
    from eagle3_assets.drafter import formats

    return formats.export("vllm", model, out_dir, dtype=dtype, verifier=str(model_dir), speculative_tokens=k)


def _text_config(model_dir: Path) -> dict:
    return text_config(read_config(model_dir))


def served_vs_project(api_url: str, embedded, export_dir: Path, prompts, *, k: int, max_new_tokens: int):
    """The same export's acceptance by a speculating vLLM's counters and by the project's evaluator
    (which loads the files vLLM loaded), with the greedy reference both must reproduce:
    ``(engine, project, figures)``."""
    from eagle3_assets.drafter import formats
    from eagle3_assets.drafter.spec_decode import evaluate_acceptance, greedy_generate
    from eagle3_assets.engines.vllm.acceptance import compare, measure_acceptance

    greedy = [greedy_generate(embedded.model, p, max_new_tokens=max_new_tokens, stop_ids=embedded.stop_ids)
              for p in prompts]
    engine = measure_acceptance(api_url, prompts, k=k, max_new_tokens=max_new_tokens, greedy_reference=greedy)
    project = evaluate_acceptance(embedded.model, formats.load("vllm", export_dir).float().eval(), prompts, k=k,
                                  max_new_tokens=max_new_tokens, stop_ids=embedded.stop_ids, greedy_reference=greedy)
    return engine, project, compare(project.as_metadata(), engine)


def acceptance_counts(engine, project, label: str = "vllm") -> dict:
    """The integer counts behind both acceptance figures, an engine's counters (vLLM's by default)
    and the project's evaluator side by side: verification steps with drafts, draft tokens, accepted
    tokens, and accepted tokens at each draft position (recovered exactly from the rates:
    count / steps * steps)."""
    k = project.k
    accepted = sum(j * n for j, n in enumerate(project.accepted_histogram))
    return {
        label: {"drafts": engine.drafts, "draft_tokens": engine.draft_tokens, "accepted_tokens": engine.accepted_tokens,
                "accepted_per_position": [round(r * engine.drafts) for r in engine.per_position_rate]},
        "project": {"drafts": project.verify_steps, "draft_tokens": k * project.verify_steps, "accepted_tokens": accepted,
                    "accepted_per_position": [round(r * project.verify_steps) for r in project.per_position_rate]},
    }


def settled_counts(target, drafter, prompts, *, k: int, max_new_tokens: int, stop_ids: list[int],
                   limit: int = 4096) -> list[dict]:
    """The evaluator's counts (as ``acceptance_counts`` gives them) under every way of settling the
    near-ties it meets (``spec_decode.tie_outcomes`` per prompt, combined over the prompts)."""
    from itertools import product

    from eagle3_assets.drafter.spec_decode import tie_outcomes

    def counts(results) -> tuple[int, ...]:
        acc = [a for r in results for a in r.accepted]
        return (len(acc), *(sum(a >= j for a in acc) for j in range(1, k + 1)))

    per_prompt = [tie_outcomes(target, drafter, p, k=k, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
                  for p in prompts]
    combos = 1
    for outcomes in per_prompt:
        combos *= len(outcomes)
    assert combos <= limit, f"{combos} ways to settle the near-ties: too many to list"
    found = {counts(results) for results in product(*per_prompt)}
    return [{"drafts": c[0], "draft_tokens": k * c[0], "accepted_tokens": sum(c[1:]), "accepted_per_position": list(c[1:])}
            for c in sorted(found)]


def assert_counts_agree(engine_counts: dict, project_counts: dict, project, settle) -> str:
    """An engine's counts equal the evaluator's step for step (``"exact"``), or, where the evaluator
    met near-ties (``project.near_ties``), equal its counts with some of them settled the other way
    (``"near-tie"``): ``settle()`` lists those (``settled_counts``). Anything else fails."""
    if engine_counts == project_counts:
        return "exact"
    assert project.near_ties, ("counts differ and the evaluator met no near-tie", engine_counts, project_counts)
    alternatives = settle()
    assert engine_counts in alternatives, ("counts differ beyond the near-ties", engine_counts, alternatives)
    return "near-tie"
