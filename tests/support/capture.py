"""A stand-in for SGLang's per-rank capture, for running the tensor-parallel extraction on CPU.

``local_capture`` is a capture factory for ``sglang_extract --capture``: every rank loads the
real target with transformers and answers ``rows -> (aux, last)`` packed, as
``SGLangCapture.capture`` does, and appends what it ran to ``<out_dir>.rank<r>.jsonl`` (with
``.node<n>`` before ``.rank`` in a job of a TP group per node) so a test can check that every
rank ran the same forwards on the same rows.
"""

from __future__ import annotations

import json
import os

import torch


def local_capture(job, group, layer_ids):
    from eagle3_assets.engines.local.extractor import LocalExtractor

    extractor = LocalExtractor(job.target.model_dir, layer_ids=layer_ids)
    node = f".node{os.environ.get('SLURM_PROCID', 0)}" if getattr(job, "nodes", 1) > 1 else ""
    log = f"{job.out_dir}{node}.rank{group.rank}.jsonl"

    def capture(rows):
        feats = extractor.extract(rows)
        with open(log, "a") as fh:
            fh.write(json.dumps([len(r) for r in rows]) + "\n")
        return torch.cat([f.aux for f in feats]), torch.cat([f.last for f in feats])

    return capture
