"""User errors as one clear line: which exceptions are the user's (a bad value, a missing file, an unknown config
key) rather than a bug, and how to say them in one line, with the closest known key for a misspelt one."""

from __future__ import annotations

import dataclasses
import inspect
import re
from difflib import get_close_matches
from functools import lru_cache

UNKNOWN_KEY = re.compile(r"""(?:Option|Key|key) ['"]([\w.@/-]+)['"] (?:is not accepted|is not expected)"""
                         r"""|Unrecognized arguments:\s*(\S+)|[Nn]o action for key ['"]([\w.@/-]+)['"]""")


WRAPPER_LINES = ("Parser key", "Does not validate", "Subtypes:", "Errors:", "Expected a <class", "Given value",
                 "Problem with given class_path")
"""Lines jsonargparse wraps around the error raised inside a class's __init__."""


def is_user_error(err: BaseException) -> bool:
    """Errors the user can fix from the message alone (bad values, files, keys); other errors keep their traceback."""
    from jsonargparse import ArgumentError
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    return isinstance(err, (ValueError, FileNotFoundError, IsADirectoryError, ArgumentError, KeyError,
                            MisconfigurationException))


def _signature_names(obj: object) -> set[str]:
    try:
        return {p for p in inspect.signature(obj).parameters if p not in ("self", "args", "kwargs")}
    except (TypeError, ValueError):
        return set()


@lru_cache(maxsize=1)
def known_keys() -> tuple[str, ...]:
    """Every config key name the stage CLI accepts (the last part of a dotted key)."""
    import lightning.pytorch as pl
    from lightning.pytorch import callbacks as pl_callbacks
    from lightning.pytorch.loggers import TensorBoardLogger

    import callbacks
    import datamodules
    import glm_lightning.modules as modules
    from glm_lightning.evaluation import VerifierSettings
    from glm_lightning.rl import config as rl_config

    names = {"trainer", "model", "data", "seed_everything", "ckpt_path", "config", "print_config", "optimizer",
             "lr_scheduler", "last_checkpoint", "preflight", "class_path", "init_args"}
    classes = [pl.Trainer, TensorBoardLogger, pl_callbacks.ModelCheckpoint, pl_callbacks.EarlyStopping,
               pl_callbacks.LearningRateMonitor]
    for module in (callbacks, datamodules, modules):
        classes += [obj for obj in vars(module).values() if inspect.isclass(obj)]
    for cls in classes:
        for klass in inspect.getmro(cls):
            if klass.__module__.split(".")[0] in ("glm_lightning", "callbacks", "datamodules") or klass in classes:
                names |= _signature_names(klass)
    for holder in (VerifierSettings, *vars(rl_config).values()):
        if dataclasses.is_dataclass(holder):
            names |= {f.name for f in dataclasses.fields(holder)}
    return tuple(sorted(names))


def closest_key(name: str) -> str | None:
    """The known key most like `name` (its last dotted part), with the same dotted prefix."""
    prefix, _, leaf = name.rpartition(".")
    match = get_close_matches(leaf, known_keys(), n=1, cutoff=0.6)
    if not match:
        return None
    return f"{prefix}.{match[0]}" if prefix else match[0]


def describe(err: BaseException) -> str:
    """One line: the message's core (the innermost reason of a config error), plus the closest key if misspelt."""
    text = str(err) if not isinstance(err, KeyError) else str(err.args[0] if err.args else err)
    found = UNKNOWN_KEY.search(text)
    where = re.search(r'Parser key "([\w.]+)"', text)
    section = where.group(1) if where else ""
    if section in ("model", "data"):
        section += ".init_args"
    if found:
        key = next(g for g in found.groups() if g).lstrip("-").split("=")[0]
        full = f"{section}.{key}" if section and not key.startswith(section.split(".")[0] + ".") else key
        suggestion = closest_key(full)
        line = f"unknown config key {full!r}"
        return f"{line}; did you mean {suggestion!r}?" if suggestion and suggestion != full else line
    lines = [re.sub(r"^\s*-\s+", "", ln).strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln]
    reasons = [ln for ln in lines if not ln.startswith(WRAPPER_LINES)]
    core = " ".join(reasons or lines)
    return " ".join(core.split())
