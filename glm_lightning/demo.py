"""`make demo`: the end-to-end job on embedded defaults, no network. Each stage's checkpoint feeds the next.

Stage 1 pre-trains a small model on the classic function families and reports the greedy dev pass per family
(held-out identities, verified in the sandbox). Later stages join as they land.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from glm_lightning.cli import build_cli

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "demo"


def last_scalars(log_dir: str) -> dict[str, float]:
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: acc.Scalars(tag)[-1].value for tag in acc.Tags()["scalars"]}


def run_stage(config: Path, extra: list[str]) -> tuple[dict[str, float], str | None, float]:
    t = time.perf_counter()
    cli = build_cli(["--config", str(config), *extra], run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    ckpt = cli.trainer.checkpoint_callback.last_model_path if cli.trainer.checkpoint_callback else None
    return last_scalars(cli.trainer.log_dir), ckpt, time.perf_counter() - t


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m glm_lightning demo", description=__doc__)
    p.add_argument("--max-steps", type=int, default=None, help="override the pre-training steps (smoke runs)")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    extra = [] if args.max_steps is None else ["--trainer.max_steps", str(args.max_steps),
                                               "--trainer.val_check_interval", str(max(1, args.max_steps))]
    scalars, ckpt, secs = run_stage(CONFIGS / "pretrain.yaml", extra)
    print("\n== glm-lightning demo summary ==")
    print(f"{'stage':<14}{'metric':<34}{'value':>10}")
    print(f"{'pre-training':<14}{'wall time (s)':<34}{secs:>10.0f}")
    for tag in sorted(scalars):
        if tag.startswith("val/"):
            print(f"{'pre-training':<14}{tag:<34}{scalars[tag]:>10.3f}")
    print(f"\ncheckpoint: {ckpt}")
    print("dashboards: tensorboard --logdir lightning_logs")
