"""Precise filters for the messages every run printed that a user can neither act on nor needs: each names the
exact message it drops and why, so anything else the libraries say still shows.

- Lightning's "LightningCLI's args parameter is intended to run from within Python...": the demo and the sweep's
  config check hand the stage CLI its arguments on purpose while sys.argv holds their own;
- Lightning's tips to install `litlogger` / `litmodels` (cloud services; this lab runs offline);
- torch's "`isinstance(treespec, LeafSpec)` is deprecated", raised inside Lightning's own pytree helper;
- Lightning's "Trainer already configured with model summary callbacks": the stage CLI's own summary, on purpose;
- Lightning's "Your `IterableDataset` has `__len__` defined": the project's corpora are iterable datasets with a
  known length, served by one loader process (the warning concerns several workers).
"""

from __future__ import annotations

import logging
import warnings

DROPPED_WARNINGS = (
    r"LightningCLI's args parameter is intended to run from within Python",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    r"Your `IterableDataset` has `__len__` defined",
)
"""Regular expressions matched against the start of a warning's message."""

DROPPED_TIPS = ("litlogger", "litmodels")
"""Lightning's "💡 Tip: ... try installing [litlogger]" / "[litmodels]" log records."""

TIP_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
"""The loggers Lightning's rank_zero_info writes through."""


DROPPED_INFO = ("Trainer already configured with model summary callbacks",)
"""Lightning's note that the run brings its own model summary: the stage CLI adds `callbacks.summary.ParamsSummary`
to every run on purpose (its summary leaves out the FLOPs Lightning cannot count here)."""


class _NoInstallTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(DROPPED_INFO):
            return False
        return not (message.startswith("💡 Tip") and any(f"[{name}]" in message for name in DROPPED_TIPS))


_TIP_FILTER = _NoInstallTips()


def quiet_known_noise() -> None:
    """Install the filters (idempotent: a filter already in place is not added twice)."""
    for pattern in DROPPED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for name in TIP_LOGGERS:
        logger = logging.getLogger(name)
        if _TIP_FILTER not in logger.filters:
            logger.addFilter(_TIP_FILTER)


RESUME_WARNINGS = (
    r"Checkpoint directory .* exists and is not empty",
    r"The dirpath has changed from",
)
"""ModelCheckpoint's warnings when a command starts from `--ckpt_path`: resuming continues in the checkpoint's own
run folder on purpose (`stage_cli.resume_into_same_run`), so its checkpoints directory is not empty; `validate` and
`test` of a checkpoint train nothing, so where its callbacks' state would be reloaded does not matter."""


def quiet_resume_noise() -> None:
    """Install the `RESUME_WARNINGS` filters (only for a command given `--ckpt_path`: a fresh run into a folder that
    already holds checkpoints still gets Lightning's warning)."""
    for pattern in RESUME_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
