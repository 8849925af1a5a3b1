"""The recipe's optimizer: AdamW on everything, or Muon on the 2-D weights and AdamW on the rest.

Muon (``torch.optim.Muon``) orthogonalises each matrix's momentum (Newton-Schulz); it is for
hidden 2-D weights only, so the output head (its rows are per-token, like an embedding) and the
norm gains stay on AdamW. ``adjust_lr_fn="match_rms_adamw"`` scales Muon's step to AdamW's RMS,
so one ``lr`` and ``weight_decay`` serve both. Each optimizer has its own ``LambdaLR`` with the
recipe's schedule; :class:`Optimizers` steps them together and checkpoints them as one.
"""

from __future__ import annotations

import torch

from eagle3_assets.drafter.training.config import TrainSettings


def _muon_param(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 2 and not name.startswith("lm_head.")


class Optimizers:
    """One or two (optimizer, scheduler) pairs behind the optimizer/scheduler calls the loop makes."""

    def __init__(self, settings: TrainSettings, model: torch.nn.Module, total_steps: int):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        adamw = dict(lr=settings.lr, betas=tuple(settings.betas), weight_decay=settings.weight_decay)
        if all(p.is_cuda for _, p in named):
            adamw["fused"] = True  # one kernel for every weight's update instead of a loop of small ones
        if settings.optimizer == "muon":
            muon = [p for n, p in named if _muon_param(n, p)]
            rest = [p for n, p in named if not _muon_param(n, p)]
            self.optimizers = [torch.optim.Muon(muon, lr=settings.lr, weight_decay=settings.weight_decay,
                                                momentum=settings.betas[0], adjust_lr_fn="match_rms_adamw"),
                               torch.optim.AdamW(rest, **adamw)]
        else:
            self.optimizers = [torch.optim.AdamW([p for _, p in named], **adamw)]
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda i: settings.lr_factor(i, total_steps))
                           for o in self.optimizers]

    @property
    def lr(self) -> float:
        return self.optimizers[0].param_groups[0]["lr"]

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)

    def step(self) -> None:
        for o, s in zip(self.optimizers, self.schedulers):
            o.step()
            s.step()

    def state_dict(self) -> tuple[dict, dict]:
        """(optimizer state, scheduler state); one optimizer's are its own dicts, as before Muon."""
        if len(self.optimizers) == 1:
            return self.optimizers[0].state_dict(), self.schedulers[0].state_dict()
        return ({"optimizers": [o.state_dict() for o in self.optimizers]},
                {"schedulers": [s.state_dict() for s in self.schedulers]})

    def load_state_dict(self, optimizer: dict, scheduler: dict) -> None:
        opts = optimizer["optimizers"] if "optimizers" in optimizer else [optimizer]
        scheds = scheduler["schedulers"] if "schedulers" in scheduler else [scheduler]
        for o, st in zip(self.optimizers, opts, strict=True):
            o.load_state_dict(st)
        for s, st in zip(self.schedulers, scheds, strict=True):
            s.load_state_dict(st)
