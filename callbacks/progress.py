"""StepProgressBar: Lightning's rich progress bar without "Epoch 0/-2" on step-based runs.

A run bounded by `max_steps` has `max_epochs = -1` (no epoch limit), which RichProgressBar prints as "Epoch 0/-2";
this bar shows "Epoch 0" then, and "Epoch 0/4" when the run is bounded by epochs.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar


class StepProgressBar(RichProgressBar):
    """RichProgressBar whose epoch label omits a limit that does not exist."""

    def _get_train_description(self, current_epoch: int) -> str:
        description = super()._get_train_description(current_epoch)
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs < 0:
            description = description.replace(f"Epoch {current_epoch}/{max_epochs - 1}", f"Epoch {current_epoch}", 1)
        return description
