"""FreezeCallback: train only the parameters whose names match glob patterns, optionally unfreeze more later.

    callbacks:
      - class_path: callbacks.freeze.FreezeCallback
        init_args:
          train: ["vision.*", "model.blocks.11.*", "model.final_norm.*", "model.lm_head.*"]
          unfreeze: ["model.blocks.10.*"]      # optional: joins the optimizer at epoch `unfreeze_at_epoch`
          unfreeze_at_epoch: 2
          unfreeze_lr_factor: 0.1              # the new group's lr = peak lr * factor (then follows the schedule)

Names are those of the LightningModule's ``named_parameters()`` (so the shared model's start with ``model.``), matched
with :func:`fnmatch.fnmatchcase`. A pattern that matches no parameter raises ValueError, listing the closest names.

Freezing happens in ``setup`` (``BaseFinetuning.freeze_before_training``), i.e. before ``configure_optimizers``, so
the optimizer must be built from ``requires_grad`` parameters only (``StageModule`` does that; do not use the CLI's
``--optimizer``). At the unfreeze epoch the newly trainable parameters are added to the optimizer as new param group(s)
(one per weight-decay class, following ``glm_lightning.modules.base.no_weight_decay``); a step-wise ``LambdaLR`` is
extended so the new groups follow the same warm-up/cosine multiplier. Resuming from a checkpoint taken after the
unfreeze epoch keeps those parameters trainable (Lightning #21901).

Trainable/total parameter counts are printed (rank zero) and sent to the logger as hyperparameters and as text.
"""

from __future__ import annotations

from collections.abc import Sequence
from difflib import get_close_matches
from fnmatch import fnmatchcase
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.utilities import rank_zero_info
from torch.optim import Optimizer

from glm_lightning.modules.base import no_weight_decay


def _check_patterns(name: str, patterns: Any) -> list[str]:
    if isinstance(patterns, str) or not isinstance(patterns, Sequence) or not patterns:
        raise ValueError(f"{name} must be a non-empty list of glob patterns, got {patterns!r}")
    if not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(f"{name} patterns must be non-empty strings, got {patterns!r}")
    return list(patterns)


def match_parameters(names: Sequence[str], patterns: Sequence[str], what: str = "pattern") -> set[str]:
    """Names matching any of the glob `patterns`; ValueError if some pattern matches nothing."""
    matched: set[str] = set()
    for pattern in patterns:
        hits = {n for n in names if fnmatchcase(n, pattern)}
        if not hits:
            raise ValueError(f"{what} {pattern!r} matches no parameter; closest names: "
                             f"{', '.join(closest_patterns(names, pattern))}")
        matched |= hits
    return matched


def closest_patterns(names: Sequence[str], pattern: str, n: int = 5) -> list[str]:
    """Names (cut to the pattern's depth, with its wildcard tail) that look most like `pattern`, e.g.
    `model.blocks.3.*` for `model.blocks.11.*` on a 4-block model."""
    depth = pattern.count(".") + 1
    tail = pattern.split(".")[-1] if "*" in pattern.split(".")[-1] else ""
    cut = {".".join(n.split(".")[: depth - 1] + [tail]) if tail and n.count(".") >= depth - 1
           else ".".join(n.split(".")[:depth]) for n in names}
    return get_close_matches(pattern, sorted(cut), n=n, cutoff=0.0) or list(names)[:n]


class FreezeCallback(BaseFinetuning):
    """Freeze everything except parameters matching `train`; unfreeze `unfreeze` at epoch `unfreeze_at_epoch`.

    Args:
        train: fnmatch glob patterns of the parameters to train from the start.
        unfreeze: patterns of parameters to unfreeze later (they stay frozen until then).
        unfreeze_at_epoch: epoch (0-based) at whose start `unfreeze` joins the optimizer.
        unfreeze_lr_factor: learning rate of the new group(s) relative to the optimizer's first group.
    """

    def __init__(
        self,
        train: list[str],
        unfreeze: list[str] | None = None,
        unfreeze_at_epoch: int | None = None,
        unfreeze_lr_factor: float = 0.1,
    ) -> None:
        super().__init__()
        self.train = _check_patterns("train", train)
        self.unfreeze = _check_patterns("unfreeze", unfreeze) if unfreeze is not None else None
        if (self.unfreeze is None) != (unfreeze_at_epoch is None):
            raise ValueError("unfreeze and unfreeze_at_epoch must be given together")
        if unfreeze_at_epoch is not None and unfreeze_at_epoch < 0:
            raise ValueError(f"unfreeze_at_epoch must be >= 0, got {unfreeze_at_epoch}")
        if not unfreeze_lr_factor > 0:
            raise ValueError(f"unfreeze_lr_factor must be > 0, got {unfreeze_lr_factor}")
        self.unfreeze_at_epoch = unfreeze_at_epoch
        self.unfreeze_lr_factor = float(unfreeze_lr_factor)
        self.trainable_names: set[str] = set()
        self.unfrozen_names: set[str] = set()
        self.trainable_params = 0
        self.total_params = 0

    # --- BaseFinetuning hooks -------------------------------------------------------------------------------------
    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        params = dict(pl_module.named_parameters())
        names = list(params)
        self.trainable_names = match_parameters(names, self.train, "train pattern")
        if self.unfreeze is not None:
            match_parameters(names, self.unfreeze, "unfreeze pattern")
        for name, p in params.items():
            p.requires_grad_(name in self.trainable_names)
        self._count(pl_module)
        rank_zero_info(f"FreezeCallback: training {self.trainable_params:,} of {self.total_params:,} parameters "
                       f"({len(self.trainable_names)} tensors matching {self.train})")

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: Optimizer) -> None:
        if self.unfreeze is None or epoch != self.unfreeze_at_epoch:
            return
        in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
        params = dict(pl_module.named_parameters())
        new = {n: p for n in sorted(match_parameters(list(params), self.unfreeze, "unfreeze pattern"))
               if id(p := params[n]) not in in_optimizer}
        if not new:
            return
        for p in new.values():
            p.requires_grad_(True)
        first = optimizer.param_groups[0]
        base_lr = first.get("initial_lr", first["lr"]) * self.unfreeze_lr_factor
        decay = max((g.get("weight_decay", 0.0) for g in optimizer.param_groups), default=0.0)
        groups: dict[bool, list[torch.Tensor]] = {True: [], False: []}
        for name, p in new.items():
            groups[no_weight_decay(name, p)].append(p)
        n_before = len(optimizer.param_groups)
        for skip_decay, ps in groups.items():
            if ps:
                optimizer.add_param_group({"params": ps, "lr": base_lr, "initial_lr": base_lr,
                                           "weight_decay": 0.0 if skip_decay else decay})
        self._extend_schedulers(pl_module.trainer, optimizer, n_before)
        self.unfrozen_names |= set(new)
        self._count(pl_module)
        rank_zero_info(f"FreezeCallback: epoch {epoch}: unfroze {sum(p.numel() for p in new.values()):,} parameters "
                       f"({len(new)} tensors matching {self.unfreeze}, lr x{self.unfreeze_lr_factor}); now training "
                       f"{self.trainable_params:,} of {self.total_params:,}")
        self._log_counts(pl_module.trainer, f"epoch {epoch}: unfroze {self.unfreeze}")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        restarting = self._restarting
        super().on_fit_start(trainer, pl_module)  # restores param groups added before a checkpoint
        if restarting:
            # setup() froze everything again; parameters that the optimizer holds must train (Lightning #21901)
            names = {id(p): n for n, p in pl_module.named_parameters()}
            for optimizer in trainer.optimizers:
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        p.requires_grad_(True)
                        if names.get(id(p)) not in self.trainable_names:
                            self.unfrozen_names.add(names.get(id(p), "?"))
                self._extend_schedulers(trainer, optimizer, None)
            self._count(pl_module)
        self._log_counts(trainer, f"train {self.train}")

    # --- helpers --------------------------------------------------------------------------------------------------
    def _count(self, pl_module: pl.LightningModule) -> None:
        self.total_params = sum(p.numel() for p in pl_module.parameters())
        self.trainable_params = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)

    @staticmethod
    def _extend_schedulers(trainer: pl.Trainer, optimizer: Optimizer, n_before: int | None) -> None:
        """Give LR schedulers of `optimizer` an entry per param group (LambdaLR ignores groups it does not know)."""
        for config in getattr(trainer, "lr_scheduler_configs", []):
            sched = config.scheduler
            if getattr(sched, "optimizer", None) is not optimizer:
                continue
            groups = optimizer.param_groups
            lambdas = getattr(sched, "lr_lambdas", None)
            if lambdas is not None:
                while len(lambdas) < len(groups):
                    lambdas.append(lambdas[0])
            base = getattr(sched, "base_lrs", None)
            if base is not None:
                while len(base) < len(groups):
                    g = groups[len(base)]
                    base.append(g.get("initial_lr", g["lr"]))
            if n_before is not None and lambdas is not None and base is not None:
                step = getattr(sched, "last_epoch", 0)
                for i in range(n_before, len(groups)):
                    groups[i]["lr"] = base[i] * lambdas[i](max(step, 0))
            if hasattr(sched, "_last_lr"):
                sched._last_lr = [g["lr"] for g in groups]

    def _log_counts(self, trainer: pl.Trainer, event: str) -> None:
        stats = {"freeze/trainable_params": self.trainable_params, "freeze/total_params": self.total_params}
        for logger in trainer.loggers:
            logger.log_hyperparams(stats)
            writer = getattr(logger, "experiment", None)
            if writer is not None and hasattr(writer, "add_text"):
                writer.add_text("freeze/summary", f"{event}: trainable **{self.trainable_params:,}** of "
                                f"{self.total_params:,} parameters", trainer.global_step)
