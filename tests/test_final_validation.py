"""A fit that stops between two evaluations is evaluated at its last step (once, not twice when the schedule already
evaluates there), and says before its first step that no evaluation is scheduled in time."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from glm_lightning.cli import main

CONF = str(Path(__file__).parent / "conf" / "pretrain_tiny.yaml")


def _val_steps(save_dir: Path) -> list[int]:
    """The steps `val/loss` was logged at (Lightning logs an evaluation after batch k at step k - 1)."""
    acc = EventAccumulator(str(next(save_dir.glob("test/version_0"))), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars("val/loss")] if "val/loss" in acc.Tags()["scalars"] else []


def _fit(tmp_path: Path, max_steps: int, interval: int, *extra: str) -> list[int]:
    main(["fit", "--config", CONF, "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.max_steps",
          str(max_steps), "--trainer.val_check_interval", str(interval), "--trainer.check_val_every_n_epoch", "null",
          "--model.init_args.dev_eval", "false", "--trainer.default_root_dir", str(tmp_path), *extra])
    return _val_steps(tmp_path)


def test_a_run_that_ends_before_its_first_evaluation_is_evaluated_at_the_end_and_warned(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    steps = _fit(tmp_path, 3, 10)
    assert steps == [2]
    said = [r.getMessage() for r in caplog.records if "[evaluation] warning" in r.getMessage()]
    assert len(said) == 1 and re.search(r"stops at step 3 .* it is evaluated once, at its last step", said[0])


def test_a_run_evaluated_at_its_last_step_anyway_is_evaluated_once(tmp_path):
    assert _fit(tmp_path, 4, 2) == [1, 3]


def test_a_run_between_evaluations_gets_a_last_one(tmp_path):
    assert _fit(tmp_path, 5, 2) == [1, 3, 4]


def test_switched_off_it_keeps_lightnings_schedule(tmp_path):
    assert _fit(tmp_path, 3, 10, "--final_validation.enabled", "false") == []
