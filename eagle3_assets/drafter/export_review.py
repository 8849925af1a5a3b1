"""One review of a drafter's serving exports, for ``drafter_acceptance`` and ``eagle3 export`` alike.

A format check alone passes an export whose aux layer ids name other layers than the drafter was
trained on (the engine then serves it on the wrong features, silently). So both callers run this:
each engine's export checked against its serving contract, and its ``eagle_aux_hidden_state_layer_ids``
against the training shards' manifest, each in that engine's own numbering.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from eagle3_assets.drafter import formats
from eagle3_assets.drafter.trained_layers import trained_layers, trained_layers_for


@dataclass
class ExportReview:
    layers: dict | None  # the training shards' ``layers`` record, None when it cannot be read
    format_problems: list[str] = field(default_factory=list)  # "<engine> export: ..." serving-contract problems
    layer_problems: list[str] = field(default_factory=list)  # the link to training: ids differ, record missing

    @property
    def problems(self) -> list[str]:
        return self.format_problems + self.layer_problems

    def trained_ids(self, engine: str) -> list[int] | None:
        """The training layers in ``engine``'s numbering (what its export must name)."""
        return trained_layers_for(self.layers, engine) if self.layers else None


def review_exports(drafter_dir: Path, engines) -> ExportReview:
    """The exports of ``engines`` under ``drafter_dir`` (``<dir>/<engine>``) against their serving
    contracts and against the layers in the training manifests (``job.json`` -> shards)."""
    drafter_dir = Path(drafter_dir)
    try:
        review = ExportReview(trained_layers(drafter_dir))
    except (OSError, ValueError, KeyError) as exc:
        review = ExportReview(None, layer_problems=[f"training layers: {exc}"])
    for engine in engines:
        export_dir = drafter_dir / engine
        review.format_problems += [f"{engine} export: {p}" for p in formats.file_problems(engine, export_dir)]
        review.layer_problems += [f"{engine} export: {p}" for p in formats.layer_problems(engine, export_dir, review.layers)]
    return review


def evaluation_link_problems(ev: dict, drafter_dir: Path, engines, recipe: str) -> list[str]:
    """The exports ``ev`` (eval.json) measured against the files under ``drafter_dir`` now, every one of
    ``engines``: an export changed since, or one eval.json holds no fingerprint of, is a problem."""
    from eagle3_assets.drafter.export_fingerprint import fingerprint_problems

    return fingerprint_problems(ev.get("exports"), drafter_dir, engines, by="eval.json",
                                fix=f"re-materialize drafter_checkpoint[{recipe}]")
