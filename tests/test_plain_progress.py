"""Off a terminal (a pipe, a file, CI) the configured rich bar, which prints nothing until the end there, becomes a
plain line at a steady interval: step, loss, rate, ETA."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from jsonargparse import Namespace

from callbacks.progress import PlainProgressBar
from glm_lightning.cli import main
from glm_lightning.stage_cli import PLAIN_PROGRESS, plain_progress_off_terminal

CONF = str(Path(__file__).parent / "conf" / "pretrain_tiny.yaml")


def _config(bar: str | None = "callbacks.progress.StepProgressBar", enabled: bool | None = None) -> Namespace:
    callbacks = [Namespace(class_path="lightning.pytorch.callbacks.LearningRateMonitor", init_args=Namespace())]
    if bar:
        callbacks.append(Namespace(class_path=bar, init_args=Namespace(leave=True)))
    return Namespace(trainer=Namespace(callbacks=callbacks, enable_progress_bar=enabled, fast_dev_run=False))


def test_the_bar_is_swapped_only_off_a_terminal(monkeypatch):
    monkeypatch.delenv("GLM_PROGRESS", raising=False)
    on_terminal = _config()
    assert not plain_progress_off_terminal(on_terminal, is_terminal=True)
    assert on_terminal.trainer.callbacks[-1].class_path.endswith("StepProgressBar")
    piped = _config()
    assert plain_progress_off_terminal(piped, is_terminal=False)
    assert [cb.class_path for cb in piped.trainer.callbacks][-1] == PLAIN_PROGRESS
    assert piped.trainer.callbacks[-1].init_args == Namespace(), "the rich bar's settings are not the plain one's"
    no_bar = _config(bar=None)
    assert plain_progress_off_terminal(no_bar, is_terminal=False) and no_bar.trainer.callbacks[-1].class_path == \
        PLAIN_PROGRESS
    disabled = _config(enabled=False)
    assert not plain_progress_off_terminal(disabled, is_terminal=False)
    monkeypatch.setenv("GLM_PROGRESS", "rich")
    assert not plain_progress_off_terminal(_config(), is_terminal=False)
    monkeypatch.setenv("GLM_PROGRESS", "plain")
    assert plain_progress_off_terminal(_config(), is_terminal=True)


def test_the_line_says_step_loss_rate_and_eta():
    bar = PlainProgressBar(interval_s=5)
    bar._start, bar._start_step = 100.0, 0
    trainer = SimpleNamespace(global_step=40, max_steps=150, callback_metrics={"train/loss": torch.tensor(1.23456)})
    line = bar.line(trainer, now=120.0)  # 40 steps in 20 s: 2 steps/s, 110 steps left: 55 s
    assert line == "[progress] step 40/150 (27%), loss 1.2346, 2.00 steps/s, ETA 0:00:55"


def test_a_piped_fit_prints_plain_lines(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GLM_PROGRESS", "plain")
    main(["fit", "--config", CONF, "--trainer.enable_progress_bar", "true", "--trainer.max_steps", "2",
          "--trainer.limit_val_batches", "0", "--trainer.logger", "false",
          "--trainer.default_root_dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "[progress] training from step 0" in out and "[progress] step 2/2 (100%)" in out and "(done)" in out


def test_the_rich_bar_counts_steps_against_max_steps_and_shows_no_version(tmp_path, monkeypatch):
    """After a resume the rich bar read `40/33` (batches of an epoch) and `v_num: on_2` (the last 4 characters of
    `version_2`); a step-bounded run now counts optimizer steps against max_steps."""
    from callbacks.progress import StepProgressBar

    bar = StepProgressBar()
    trainer = SimpleNamespace(max_epochs=-1, max_steps=150, global_step=40, num_training_batches=33)
    monkeypatch.setattr(StepProgressBar, "trainer", property(lambda self: trainer))
    assert bar.total_train_batches == 150
    seen = []
    monkeypatch.setattr("lightning.pytorch.callbacks.RichProgressBar.on_train_batch_end",
                        lambda self, tr, pm, out, b, idx: seen.append(idx + 1))
    bar.on_train_batch_end(trainer, None, None, None, batch_idx=6)
    assert seen == [40], "the bar's position is the step, not the batch of the epoch"
    trainer.max_epochs, trainer.max_steps = 3, -1
    assert bar.total_train_batches == 33
    monkeypatch.setattr("lightning.pytorch.callbacks.RichProgressBar.get_metrics",
                        lambda self, tr, pm: {"v_num": "on_2", "train/loss": 1.0})
    assert bar.get_metrics(trainer, None) == {"train/loss": 1.0}
