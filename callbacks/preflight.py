"""Preflight: configuration mistakes that would otherwise surface only at validation time (after minutes of
training) or never, found before the first step, each naming the config keys to change.

- a `ModelCheckpoint` / `EarlyStopping` monitor key the run will never log (e.g. `val/dev_pass` with
  `dev_eval: false`); checked when the stage declares what it logs (`promised_metrics`);
- data rows longer than the model's context (`data.init_args.seq_len` > the preset's `max_seq_len`);
- a `FreezeCallback` pattern that matches no parameter (the error lists the closest names);
- a stage that needs start weights (vision, RL) run without `init_weights` (only when training or evaluating, not
  when a config is merely checked: `init_weights: null` states on purpose that training starts from random weights).

`check_run` is called by the project CLI's config checker (`stage_cli.check_config`) and, through the
`Preflight` callback that the CLI adds to every run, in `setup`, i.e. before any training step.
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the keys to change."""


def _monitors(callbacks: Sequence[Any]) -> list[tuple[int, str, str]]:
    """(index in trainer.callbacks, class name, monitored key) of every checkpoint / early-stopping callback."""
    out = []
    for i, cb in enumerate(callbacks):
        if isinstance(cb, (ModelCheckpoint, EarlyStopping)) and getattr(cb, "monitor", None):
            out.append((i, type(cb).__name__, cb.monitor))
    return out


def check_monitors(model: Any, datamodule: Any, callbacks: Sequence[Any]) -> None:
    promise = getattr(model, "promised_metrics", None)
    promised = promise(datamodule) if callable(promise) else None
    if promised is None:
        return  # the stage does not declare its metrics
    for cb in callbacks:
        extra = getattr(cb, "promised_metrics", None)
        if callable(extra):
            promised = [*promised, *extra()]
    for i, name, key in _monitors(callbacks):
        if not any(fnmatchcase(key, pattern) for pattern in promised):
            hint = getattr(model, "metric_hint", lambda k: "")(key)
            raise ConfigError(
                f"trainer.callbacks: {name} monitors {key!r}, which this run never logs{hint}. "
                f"Change its `monitor` to one of {sorted(p for p in promised if '*' not in p)}, or remove it.")


def check_seq_len(model: Any, datamodule: Any) -> None:
    cfg = getattr(model, "glm_config", None)
    seq_len = getattr(getattr(datamodule, "hparams", {}), "get", lambda *_: None)("seq_len")
    if cfg is None or not isinstance(seq_len, int) or seq_len <= cfg.max_seq_len:
        return
    preset = getattr(model, "hparams", {}).get("preset", "?")
    raise ConfigError(
        f"data.init_args.seq_len={seq_len} is longer than the model's context max_seq_len={cfg.max_seq_len} "
        f"(preset {preset!r}): set `model.init_args.model_overrides: {{max_seq_len: {seq_len}}}` or lower "
        f"data.init_args.seq_len to {cfg.max_seq_len}.")


def check_freeze_patterns(model: Any, callbacks: Sequence[Any]) -> None:
    from callbacks.freeze import FreezeCallback, match_parameters

    names = [n for n, _ in model.named_parameters()] if isinstance(model, pl.LightningModule) else []
    if not names:
        return
    for i, cb in enumerate(callbacks):
        if isinstance(cb, FreezeCallback):
            for key, patterns in (("train", cb.train), ("unfreeze", cb.unfreeze)):
                if patterns:
                    match_parameters(names, patterns, f"trainer.callbacks: FreezeCallback {key} pattern")


def check_init_weights(model: Any, ckpt_path: Any = None) -> None:
    check = getattr(model, "check_start_weights", None)
    if callable(check) and ckpt_path is None:
        check()


def check_run(model: Any, datamodule: Any, callbacks: Sequence[Any]) -> None:
    """The config-time checks (all but start weights); raise ConfigError (a ValueError) naming the keys to change."""
    check_seq_len(model, datamodule)
    check_freeze_patterns(model, callbacks)
    check_monitors(model, datamodule, callbacks)


class Preflight(Callback):
    """Runs the preflight checks before the first training step (added to every run by the project CLI): the
    config checks in `setup`, the start-weights check once any `--ckpt_path` is known (fit / validate / test
    start)."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_run(pl_module, trainer.datamodule, trainer.callbacks)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check_init_weights(pl_module, trainer.ckpt_path)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "validate":
            check_init_weights(pl_module, trainer.ckpt_path)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check_init_weights(pl_module, trainer.ckpt_path)
