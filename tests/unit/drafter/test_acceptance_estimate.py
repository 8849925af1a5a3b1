"""The acceptance estimate (EAL) the trainer logs at each checkpoint, on a tiny synthetic drafter (seconds).

- the formula and the rank correlation against figures worked out by hand;
- every checkpoint's estimate lands in the step metrics, metrics.json and the checkpoint; the best
  one's file survives the rotation, ``checkpoints/best`` names it and ``use_best`` loads its weights;
- the held-out samples are taken from each shard directory in turn.

That the estimate counts the chains a decoder would accept is checked against the replay evaluator
on a drafter trained on the real target (``tests/unit/drafter/test_drafter.py``).
"""

import copy
import json

import pytest
import torch

from eagle3_assets.drafter.training.acceptance import expected_accepted_length, spearman
from eagle3_assets.drafter.training.checkpoints import checkpoint_path, checkpoints_dir, load_checkpoint
from eagle3_assets.drafter.training.config import TrainSettings
from eagle3_assets.drafter.training.data import eval_split
from eagle3_assets.drafter.training.loop import Trainer
from eagle3_assets.drafter.training.teacher import Teacher
from eagle3_assets.hidden_states.write import write_samples
from tests.unit.drafter.test_drafter_recipe_options import Batches, batch_of, tiny_drafter


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_expected_accepted_length_and_rank_correlation_by_hand():
    assert expected_accepted_length([0.8, 0.5, 0.25], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    assert expected_accepted_length([0.8, 0.5, 0.25], 1) == pytest.approx(1.8)
    assert expected_accepted_length([0.8, 0.5], 5) == pytest.approx(2.2)  # no longer than the positions known
    assert spearman([1, 2, 3, 4], [10, 30, 20, 40]) == pytest.approx(0.8)  # 1 - 6 * 2 / (4 * 15)
    # ties share their mean rank: ranks (1, 2.5, 2.5, 4) against (1, 2, 3, 4), Pearson 4.5 / sqrt(4.5 * 5)
    assert spearman([0.1, 0.2, 0.2, 0.3], [1, 2, 3, 4]) == pytest.approx(4.5 / (4.5 * 5) ** 0.5)
    assert spearman([3, 2, 1], [1.0, 1.5, 2.0]) == pytest.approx(-1.0)
    assert spearman([1, 2], [1, 2]) is None and spearman([1, 1, 1], [1, 2, 3]) is None
    with pytest.raises(ValueError, match="3 figures against 2"):
        spearman([1, 2, 3], [1, 2])


def test_the_best_checkpoint_by_the_estimate_is_kept_pointed_to_and_loaded(tmp_path):
    model, vmap, head = tiny_drafter()
    train = Batches([batch_of([12, 9, 5], head, vmap, seed=i) for i in range(4)])
    held_out = Batches([batch_of([30, 17, 8], head, vmap, seed=100 + i) for i in range(2)])
    settings = TrainSettings(max_steps=8, ttt_steps=3, lr=0.1, checkpoint_every=1, keep_checkpoints=1)
    trainer = Trainer(settings, copy.deepcopy(model), train, Teacher(head, vmap), tmp_path, progress=False,
                      eval_data=held_out, eal_k=2)
    result = trainer.run()

    estimates = [m["acceptance_estimate"] for m in result.metrics]
    assert [e["step"] for e in estimates] == list(range(1, 9)) and {e["k"] for e in estimates} == {2}
    assert all(e["samples"] == 6 and e["eal"] == expected_accepted_length(e["acceptance_rate"], 2) for e in estimates)
    assert json.loads((tmp_path / "metrics.json").read_text())[-1]["acceptance_estimate"] == estimates[-1]
    best = max(estimates, key=lambda e: e["eal"])  # the first of equals
    assert best["step"] != 8, "this run's best checkpoint must not be its last, or the rest proves nothing"
    assert trainer.best() == best
    names = sorted(p.name for p in checkpoints_dir(tmp_path).glob("step-*.pt"))
    assert names == [checkpoint_path(tmp_path, best["step"]).name, "step-00000008.pt"]  # the rotation keeps 1 + the best
    assert (checkpoints_dir(tmp_path) / "best").read_text() == names[0]
    kept = load_checkpoint(checkpoint_path(tmp_path, best["step"]))
    assert kept["metrics"][-1]["acceptance_estimate"] == best  # the checkpoint holds its own estimate

    last = {k: v.clone() for k, v in trainer.model.trainable_state_dict().items()}
    assert trainer.use_best() == best
    now = trainer.model.trainable_state_dict()
    assert all(torch.equal(now[k], v) for k, v in kept["model"].items())
    assert any(not torch.equal(now[k], v) for k, v in last.items())


def test_held_out_samples_come_from_each_directory_in_turn(tmp_path):
    def shard(name: str, n: int, split: str):
        samples = [{"input_ids": torch.arange(4) + i, "loss_mask": torch.ones(4, dtype=torch.long),
                    "aux_hidden": torch.zeros(4, 6), "last_hidden": torch.zeros(4, 2)} for i in range(n)]
        write_samples(tmp_path / name, samples, layer_ids=[0, 1, 2], num_layers=4, target={"name": "t", "id": "t"},
                      split=split, id_prefix=name)
        return tmp_path / name

    a, b, c = shard("a", 3, "eval"), shard("b", 1, "eval"), shard("c", 2, "train")
    held = eval_split({a: 2.0, b: 0.5, c: 1.0}, max_length=8, samples=3)
    assert [held.names[d] for d, _ in held.entries] == [str(a), str(b), str(a)]  # in turn, each sample once
    assert len({sid for _, sid in held.entries}) == 3
    assert eval_split({c: 1.0}, max_length=8, samples=3) is None  # no held-out samples: no estimate
