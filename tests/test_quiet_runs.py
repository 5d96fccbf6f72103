"""A clean first contact: the installed `glm-lightning` command reports user errors as `python -m glm_lightning`
does, a run prints none of the library messages a user cannot act on, and step-based runs show no "Epoch 0/-2"."""

from __future__ import annotations

import importlib
import logging
import re
import sys
import tomllib
import warnings
from pathlib import Path

import lightning.pytorch as pl
import yaml

from callbacks.progress import StepProgressBar
from glm_lightning.cli import run
from glm_lightning.quiet import DROPPED_WARNINGS, TIP_LOGGERS, quiet_known_noise

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "tests" / "conf" / "pretrain_tiny.yaml")
NOISE = ("args parameter is intended", "LeafSpec", "IterableDataset", "litlogger", "litmodels", "weights_only")


def test_the_installed_command_goes_through_the_one_line_error_handler(capsys):
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["glm-lightning"]
    module, _, name = target.partition(":")
    entry = getattr(importlib.import_module(module), name)
    assert entry is run
    assert entry(["fit", "--config", TINY, "--ckpt_path", str(ROOT / "README.md")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: ")


def test_the_filters_drop_exactly_the_known_messages():
    messages = ["LightningCLI's args parameter is intended to run from within Python like if it were from the "
                "command line.", "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, "
                "TreeSpec) and treespec.is_leaf()` instead.", "Your `IterableDataset` has `__len__` defined."]
    assert len(messages) == len(DROPPED_WARNINGS)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_known_noise()
        for message in messages:
            warnings.warn(message, UserWarning, stacklevel=1)
        warnings.warn("Your `DataLoader` has few workers", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["Your `DataLoader` has few workers"]

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(TIP_LOGGERS[0])
    logger.addHandler(handler)
    try:
        logger.warning("💡 Tip: For seamless cloud logging, try installing [litlogger](https://pypi.org/project/...)")
        logger.warning("💡 Tip: try installing [litmodels](https://pypi.org/project/litmodels/)")
        logger.warning("💡 Tip: anything else")
    finally:
        logger.removeHandler(handler)
    assert records == ["💡 Tip: anything else"]


def test_a_run_and_its_resume_print_no_known_noise(tmp_path, monkeypatch, capsys):
    """A 1-step fit and its resume, as the demo calls the stage CLI (explicit args while sys.argv holds its own):
    none of the silenced messages, and the resume loads its checkpoint with weights_only=True."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["glm_lightning", "demo"])
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    lightning_logger = logging.getLogger("lightning.pytorch")
    lightning_logger.addHandler(handler)
    base = ["fit", "--config", TINY, "--trainer.enable_progress_bar", "false"]
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert run([*base, "--trainer.max_steps", "1"]) == 0
            last = next(tmp_path.rglob("last.ckpt"))
            assert run([*base, "--trainer.max_steps", "2", "--ckpt_path", str(last)]) == 0
    finally:
        lightning_logger.removeHandler(handler)
    said = [str(w.message) for w in seen] + records + capsys.readouterr().err.splitlines()
    assert not [line for line in said if any(word in line for word in NOISE)], said
    assert any("Restored all states" in line for line in said)


def test_step_based_runs_show_no_negative_epoch_limit():
    bar = StepProgressBar()
    for kwargs, label in (({"max_steps": 5}, "Epoch 0"), ({"max_epochs": 3}, "Epoch 0/2")):
        trainer = pl.Trainer(**kwargs, logger=False, enable_checkpointing=False, callbacks=[bar])
        bar.setup(trainer, pl.LightningModule(), "fit")
        assert bar._get_train_description(0).strip() == label


def test_configs_use_the_step_progress_bar():
    listed = [cb["class_path"] for path in ROOT.glob("configs/**/*.yaml")
              for cb in (yaml.safe_load(path.read_text()) or {}).get("trainer", {}).get("callbacks") or []
              if isinstance(cb, dict) and re.search(r"ProgressBar$", cb.get("class_path", ""))]
    assert listed and set(listed) == {"callbacks.progress.StepProgressBar"}
