"""Command line: `python -m glm_lightning {fit,validate,test} --config configs/....yaml` (LightningCLI) plus
`demo` (the end-to-end job behind `make demo`).

Every LightningModule / DataModule / callback of the project is imported here so configs may name them by class
name (`class_path: PretrainModule`); any LightningModule or LightningDataModule is accepted (subclass mode).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.cli import ArgsType, LightningCLI  # noqa: E402

import callbacks  # noqa: E402,F401  (registers callbacks for class_path lookup)
import datamodules  # noqa: E402,F401
import glm_lightning.modules  # noqa: E402,F401

EXTRA_COMMANDS = ("demo", "sweep")


class GLMCLI(LightningCLI):
    """LightningCLI with project defaults: seed 0, config saved next to the logs (overwritten on re-runs)."""


def build_cli(args: ArgsType = None, run: bool = True) -> GLMCLI:
    return GLMCLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        args=args,
        run=run,
    )


def main(args: ArgsType = None) -> None:
    argv = list(sys.argv[1:] if args is None else args)
    if argv and argv[0] == "demo":
        from glm_lightning.demo import main as demo_main

        demo_main(argv[1:])
        return
    if argv and argv[0] == "sweep":
        from glm_lightning.sweep import main as sweep_main

        sweep_main(argv[1:])
        return
    build_cli(args)  # None -> LightningCLI reads sys.argv itself (no "args and argv" warning)


if __name__ == "__main__":
    main()
