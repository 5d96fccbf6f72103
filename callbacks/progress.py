"""Progress bars: `StepProgressBar` (Lightning's rich bar without "Epoch 0/-2" on step-based runs) on a terminal,
`PlainProgressBar` (a plain line at a steady interval) when the output goes to a file or a pipe.

A run bounded by `max_steps` has `max_epochs = -1` (no epoch limit), which RichProgressBar prints as "Epoch 0/-2";
StepProgressBar shows "Epoch 0" then, and "Epoch 0/4" when the run is bounded by epochs.
"""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch.callbacks import ProgressBar, RichProgressBar


class StepProgressBar(RichProgressBar):
    """RichProgressBar whose epoch label omits a limit that does not exist; a run bounded by `max_steps` counts
    optimizer steps against it (so a resumed run reads 40/150, not 40/33 of an epoch), and the logger's version is
    not squeezed into the metrics (`v_num: on_2` for `version_2`)."""

    def _by_steps(self) -> bool:
        trainer = self.trainer
        return trainer.max_epochs is not None and trainer.max_epochs < 0 and bool(trainer.max_steps) and \
            trainer.max_steps > 0

    @property
    def total_train_batches(self) -> int | float:
        return self.trainer.max_steps if self._by_steps() else super().total_train_batches

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # the bar's position is the optimizer step when the run is bounded by steps (RichProgressBar sets batch + 1)
        super().on_train_batch_end(trainer, pl_module, outputs, batch,
                                   trainer.global_step - 1 if self._by_steps() else batch_idx)

    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items

    def _get_train_description(self, current_epoch: int) -> str:
        description = super()._get_train_description(current_epoch)
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs < 0:
            description = description.replace(f"Epoch {current_epoch}/{max_epochs - 1}", f"Epoch {current_epoch}", 1)
        return description


class PlainProgressBar(ProgressBar):
    """Progress as plain lines at a steady interval, for output that is not a terminal (`make demo | tee log`, CI,
    nohup), where a rich bar prints nothing until the end: `[progress] step 40/150 (27%) loss 1.234, 2.1 steps/s,
    ETA 0:52`. The stage CLI swaps it in for the configured bar when stdout is not a terminal."""

    def __init__(self, interval_s: float = 15.0) -> None:
        super().__init__()
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self._enabled = True
        self._start: float | None = None
        self._start_step = 0
        self._last_print = 0.0

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def line(self, trainer: Any, now: float) -> str:
        """The progress line at `now` (perf_counter seconds)."""
        step = trainer.global_step
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        done = f"step {step}/{total} ({step / total:.0%})" if total else f"step {step}"
        loss = trainer.callback_metrics.get("train/loss")
        parts = [done] + ([f"loss {float(loss):.4f}"] if loss is not None else [])
        elapsed = now - (self._start or now)
        rate = (step - self._start_step) / elapsed if elapsed > 0 else 0.0
        if rate > 0:
            parts.append(f"{rate:.2f} steps/s")
            if total:
                eta = int(max(0, total - step) / rate)
                parts.append(f"ETA {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}")
        return "[progress] " + ", ".join(parts)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._start = self._last_print = time.perf_counter()
        self._start_step = trainer.global_step
        if self._enabled:
            print(f"[progress] training from step {trainer.global_step} (a line every {self.interval_s:g} s)",
                  flush=True)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._enabled and now - self._last_print >= self.interval_s:
            self._last_print = now
            print(self.line(trainer, now), flush=True)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._enabled and not trainer.sanity_checking:
            shown = {k: float(v) for k, v in trainer.callback_metrics.items()
                     if k.startswith("val/") and k.count("/") == 1 and getattr(v, "numel", lambda: 2)() == 1}
            print(f"[progress] evaluated at step {trainer.global_step}: "
                  + ", ".join(f"{k} {v:.4g}" for k, v in sorted(shown.items())), flush=True)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._enabled:
            print(self.line(trainer, time.perf_counter()) + " (done)", flush=True)


def say(trainer: Any, message: str) -> None:
    """A line from a callback while a rich bar may be live: printed above the bar through the bar's own console (a
    plain log line would land on the bar's line), else logged as usual. Rank 0 only."""
    from lightning.pytorch.utilities import rank_zero_info

    bar = getattr(trainer, "progress_bar_callback", None)
    progress = getattr(bar, "progress", None) if isinstance(bar, RichProgressBar) else None
    if progress is not None and getattr(progress, "live", None) is not None and progress.live.is_started:
        if trainer.is_global_zero:
            progress.console.print(message, markup=False, highlight=False)
        return
    rank_zero_info(message)
