"""`last.ckpt` is always the latest state: interrupting a run at step N (Ctrl-C, SIGTERM, an exception at validation
time) leaves last.ckpt at step N, and resuming from it ends bit-identical to a run that was never interrupted."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from callbacks.last_checkpoint import LastCheckpoint
from glm_lightning.cli import main
from glm_lightning.stage_cli import build_cli

CONF = str(Path(__file__).parent / "conf" / "pretrain_tiny.yaml")
STEPS, STOP_AT = 6, 3


def _args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--config", CONF, "--trainer.max_steps", str(STEPS), "--trainer.val_check_interval", "3",
            "--model.init_args.dev_eval", "false", "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"),
            *extra]


class InterruptAt(Callback):
    """Interrupts the run once `global_step` reaches `step`, the way a user or the system would."""

    def __init__(self, step: int, how: str) -> None:
        self.step, self.how = step, how

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
        if trainer.global_step == self.step and self.how == "sigint":
            os.kill(os.getpid(), signal.SIGINT)  # arrives mid-step: the step finishes, then the run stops
        if trainer.global_step == self.step and self.how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)

    def on_validation_end(self, trainer, pl_module):  # noqa: ANN001
        if trainer.global_step == self.step and self.how == "exception":
            raise RuntimeError("a bad value found at validation time")


def _fit(tmp_path: Path, *extra: str, callbacks: tuple = (), ckpt_path: str | None = None):  # noqa: ANN202
    cli = build_cli(_args(tmp_path, *extra), run=False)
    cli.trainer.callbacks.extend(callbacks)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    return cli


def _last(cli) -> Path:  # noqa: ANN001
    cb = next(c for c in cli.trainer.callbacks if isinstance(c, LastCheckpoint))
    return cb.directory(cli.trainer) / "last.ckpt"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):  # noqa: ANN001, ANN201
    tmp = tmp_path_factory.mktemp("full")
    cli = _fit(tmp)
    ckpt = torch.load(_last(cli), weights_only=False)
    assert ckpt["global_step"] == STEPS, "last.ckpt is written at the end of training"
    return ckpt


@pytest.mark.parametrize("how, error", [("sigint", SystemExit), ("sigterm", BaseException),
                                        ("exception", RuntimeError)])
def test_interrupt_then_resume_equals_uninterrupted(tmp_path, uninterrupted, how, error):
    old_int, old_term = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    holder = {}
    try:
        with pytest.raises(error):
            holder["cli"] = build_cli(_args(tmp_path), run=False)
            holder["cli"].trainer.callbacks.append(InterruptAt(STOP_AT, how))
            holder["cli"].trainer.fit(holder["cli"].model, datamodule=holder["cli"].datamodule)
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
    last = _last(holder["cli"])
    stopped = torch.load(last, weights_only=False)
    assert stopped["global_step"] == STOP_AT + (how != "exception")  # signals let the running step finish
    resumed = torch.load(_last(_fit(tmp_path, ckpt_path=str(last))), weights_only=False)
    assert resumed["global_step"] == STEPS
    a, b = resumed["state_dict"], uninterrupted["state_dict"]
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"resumed run differs from the uninterrupted one in {different[:5]}"
    assert resumed["tokens_seen"] == uninterrupted["tokens_seen"] > 0


class RecordLast(Callback):
    def __init__(self) -> None:
        self.seen: list[int | None] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
        path = LastCheckpoint.directory(trainer) / "last.ckpt"
        self.seen.append(torch.load(path, weights_only=False)["global_step"] if path.is_file() else None)


def test_last_is_saved_on_the_step_schedule_even_with_a_monitored_best(tmp_path):
    """A monitoring ModelCheckpoint (save_last, save_top_k=1) would refresh last.ckpt only at a new best (and
    version its own copy as last-v1.ckpt beside ours): LastCheckpoint takes that job over and keeps one last.ckpt
    current on the step schedule."""
    rec = RecordLast()
    cli = _fit(tmp_path, "--last_checkpoint.every_n_train_steps", "2", "--trainer.callbacks+=ModelCheckpoint",
         "--trainer.callbacks.monitor=val/loss", "--trainer.callbacks.save_last=true", callbacks=(rec,))
    assert rec.seen[:3] == [None, None, 2] and rec.seen[4:] == [4, 4], rec.seen  # steps 2 and 4 by the schedule
    assert rec.seen[3] == 2, "the monitored checkpoint leaves last.ckpt to LastCheckpoint"
    names = sorted(p.name for p in _last(cli).parent.iterdir())
    assert "last.ckpt" in names and not any(n.startswith("last-v") for n in names), names


def test_resume_continues_in_the_same_log_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main(["fit", *_args(tmp_path), "--trainer.max_steps", "3"])
    run = tmp_path / "logs" / "test" / "version_0"
    last = run / "checkpoints" / "last.ckpt"
    assert last.is_file()
    main(["fit", *_args(tmp_path), "--ckpt_path", str(last)])
    assert sorted(p.name for p in (tmp_path / "logs" / "test").iterdir()) == ["version_0"]
    assert torch.load(last, weights_only=False)["global_step"] == STEPS
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps, tokens = [], []
    for events in sorted(run.glob("events.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        steps += [e.step for e in acc.Scalars("train/tokens_seen")]
        tokens += [e.value for e in acc.Scalars("train/tokens_seen")]
    assert steps == sorted(steps) and len(set(steps)) == len(steps) == STEPS, steps
    assert all(b > a for a, b in zip(tokens, tokens[1:])), "tokens_seen continues across the resume"
    assert (run / "hparams").is_dir(), "HPARAMS with the final metrics"


def test_fast_dev_run_writes_no_last_checkpoint(tmp_path):
    cli = _fit(tmp_path, "--trainer.fast_dev_run", "2")
    assert not _last(cli).exists()
