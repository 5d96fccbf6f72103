"""LastCheckpoint: `last.ckpt` is always the latest state of a run, so a resume never restarts from an old step.

`ModelCheckpoint(monitor=..., save_top_k=1, save_last=True)` refreshes `last.ckpt` only when it saves a new best,
so Ctrl-C or a crash could leave a stale file. This callback (added to every stage run by the project CLI) writes
`<checkpoint dir>/last.ckpt`:

- every `every_n_train_steps` optimizer steps and at the end of training;
- on the first Ctrl-C (SIGINT): the current step finishes, `last.ckpt` is written at that step boundary, then the
  run stops with KeyboardInterrupt (a second Ctrl-C interrupts at once);
- on SIGTERM: Lightning finishes the current step and raises, and the exception hook below writes it;
- on any other exception during fit (e.g. a bad value found at validation time), before the exception propagates.

Checkpoints taken at a step boundary (schedule, SIGINT, SIGTERM, validation-time errors) resume bit-exactly: the
data stream, optimizer and loop counters all continue. An exception in the middle of a training step keeps the
weights of the last completed step, but the data stream skips the batch that failed.

A `ModelCheckpoint(save_last=True)` in the same directory would write the same file too, and Lightning would then
version its copy as `last-v1.ckpt` next to ours; this callback takes that job over (it sets their `save_last` to
False at the start of fit), so the directory holds one `last.ckpt`, always the newest.

Like every checkpoint, it is off with `trainer.enable_checkpointing: false` and under `fast_dev_run`.
The directory is the first `ModelCheckpoint`'s (`<log dir>/checkpoints` by default), so the README's resume recipe
(`--ckpt_path .../checkpoints/last.ckpt`) always finds it.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

LAST_NAME = "last.ckpt"


class LastCheckpoint(Callback):
    """Keep `<checkpoint dir>/last.ckpt` current (step schedule, end of training, SIGINT/SIGTERM, exceptions).

    Args:
        every_n_train_steps: optimizer steps between saves (0 = only at the end and on interrupts/errors).
        save_on_exception: also write it when fit raises (a crash never loses the training done so far).
    """

    def __init__(self, every_n_train_steps: int = 50, save_on_exception: bool = True) -> None:
        if every_n_train_steps < 0:
            raise ValueError(f"every_n_train_steps must be >= 0, got {every_n_train_steps}")
        self.every_n_train_steps = every_n_train_steps
        self.save_on_exception = save_on_exception
        self.last_path: Path | None = None
        self._saved_step: int | None = None
        self._stop_requested = False
        self._old_sigint: Any = None

    # --- where and when -------------------------------------------------------------------------------------------
    @staticmethod
    def directory(trainer: pl.Trainer) -> Path:
        """The first ModelCheckpoint's directory, else `<log dir>/checkpoints` (ModelCheckpoint's own default)."""
        cb = trainer.checkpoint_callback
        if cb is not None and getattr(cb, "dirpath", None):
            return Path(cb.dirpath)
        return Path(trainer.log_dir or trainer.default_root_dir) / "checkpoints"

    def _active(self, trainer: pl.Trainer) -> bool:
        """Off under fast_dev_run and `trainer.enable_checkpointing: false` (no checkpoint callback at all)."""
        return not trainer.fast_dev_run and not trainer.sanity_checking and trainer.checkpoint_callback is not None

    def save(self, trainer: pl.Trainer, why: str = "") -> Path:
        """Write last.ckpt now (once per optimizer step) and return its path."""
        path = self.directory(trainer) / LAST_NAME
        if self._saved_step != trainer.global_step or self.last_path != path:
            trainer.save_checkpoint(path, weights_only=False)  # the whole state (a resume needs it); atomic write
            self._saved_step, self.last_path = trainer.global_step, path
            if why:
                from callbacks.progress import say

                say(trainer, f"[last.ckpt] step {trainer.global_step} saved ({why}): {path}")
        return path

    # --- Ctrl-C becomes a stop at the next step boundary --------------------------------------------------------------
    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self._stop_requested:  # second Ctrl-C: stop now
            raise KeyboardInterrupt
        self._stop_requested = True
        print("\n[last.ckpt] Ctrl-C: finishing this step, then saving last.ckpt (Ctrl-C again to stop at once)",
              flush=True)

    def request_stop(self) -> None:
        """What the first Ctrl-C does (also used by tests): stop after the current step, with last.ckpt saved."""
        self._stop_requested = True

    def _take_over_save_last(self, trainer: pl.Trainer) -> None:
        """Switch off `save_last` of ModelCheckpoints that write into our directory (after their setup, which
        resolves their directory): one last.ckpt, ours, and no `last-v1.ckpt` beside it."""
        if trainer.checkpoint_callback is None:
            return
        ours = self.directory(trainer).resolve()
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.save_last and cb.dirpath is not None \
                    and Path(cb.dirpath).resolve() == ours:
                cb.save_last = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take_over_save_last(trainer)
        self._stop_requested = False
        if threading.current_thread() is threading.main_thread():
            self._old_sigint = signal.signal(signal.SIGINT, self._on_sigint)

    def _restore_sigint(self) -> None:
        if self._old_sigint is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._old_sigint)
        self._old_sigint = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._active(trainer):
            return
        every = self.every_n_train_steps
        if self._stop_requested:
            path = self.save(trainer, "interrupted")
            print(f"[last.ckpt] resume with: --ckpt_path {path}", flush=True)
            raise KeyboardInterrupt
        if every and trainer.global_step % every == 0:
            self.save(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_sigint()
        if self._active(trainer):
            self.save(trainer, "end of training")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore_sigint()
        if not (self.save_on_exception and self._active(trainer)) or trainer.state.fn != "fit":
            return
        if trainer.world_size > 1:  # saving is collective; other ranks may never get here
            return
        if trainer.global_step == 0 and self._saved_step is None:
            return  # nothing trained yet
        if self._saved_step == trainer.global_step and self.last_path == self.directory(trainer) / LAST_NAME:
            return  # already saved at this step (e.g. the Ctrl-C stop)
        try:
            path = self.save(trainer, f"{type(exception).__name__}")
        except Exception as err:  # noqa: BLE001 - never hide the original exception behind a saving error
            rank_zero_info(f"[last.ckpt] could not save after {type(exception).__name__}: {err}")
            return
        rank_zero_info(f"[last.ckpt] training so far kept; resume with --ckpt_path {path}")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore_sigint()
