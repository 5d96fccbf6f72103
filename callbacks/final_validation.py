"""FinalValidation: a fit that ends between two evaluations is evaluated at its last step, as Lightning users
expect, and a run that will end before its first evaluation says so before its first step.

Without it, `--trainer.max_steps 30` on a config that evaluates every 150 steps logs no `val/*`, keeps no best
checkpoint and says nothing. Added to every run by the stage CLI (`--final_validation.enabled false` turns it off).
It asks Lightning's own loop for the validation: at the last step it sets `trainer.should_stop`, which makes the
training loop validate at that batch (the rule EarlyStopping relies on); a run already evaluating there is evaluated
once, not twice.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info


def validation_configured(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether this fit has a validation to run (a `validation_step`, a val dataloader, batches not limited to 0)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if trainer.limit_val_batches == 0 or not is_overridden("validation_step", pl_module):
        return False
    try:
        return bool(trainer.fit_loop.epoch_loop.val_loop._data_source.is_defined())
    except AttributeError:  # another Lightning layout: assume the module's validation_step has data
        return True


def first_evaluation_batch(trainer: pl.Trainer) -> float:
    """Training batches from the start of this fit to its first scheduled evaluation (inf when none is scheduled)."""
    every = trainer.val_check_batch
    if every is None or every == float("inf") or trainer._val_check_time_interval is not None:
        return math.inf
    if trainer.check_val_every_n_epoch is None:
        done = max(0, trainer.fit_loop.epoch_loop.total_batch_idx + 1)  # batches before this fit (a resume)
        return every - done % every if every else math.inf
    return every * trainer.check_val_every_n_epoch


class FinalValidation(Callback):
    """Evaluate at the last step of a fit bounded by `max_steps`; warn at the start when no evaluation is scheduled
    before that step."""

    def __init__(self, enabled: bool = True) -> None:
        """
        Args:
            enabled: evaluate at the end of a fit whose last step is not an evaluation step, and warn before such a
                run starts.
        """
        self.enabled = enabled
        self._active = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._active = self.enabled and trainer.max_steps > 0 and validation_configured(trainer, pl_module)
        if not self._active:
            return
        remaining = trainer.max_steps - trainer.global_step
        first = first_evaluation_batch(trainer)
        if first > remaining:
            scheduled = "no evaluation is scheduled" if first == math.inf else f"the first evaluation would come " \
                                                                                f"{int(first)} batches in"
            rank_zero_info(f"[evaluation] warning: this run stops at step {trainer.max_steps} ({remaining} steps from now) and {scheduled} "
                           f"(val_check_interval {trainer.val_check_interval}): it is evaluated once, at its last "
                           f"step (lower --trainer.val_check_interval to evaluate more often)")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._active and trainer.global_step >= trainer.max_steps and not trainer.should_stop:
            trainer.should_stop = True  # Lightning validates at this batch (`_should_check_val_fx`), then stops
