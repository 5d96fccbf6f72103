"""Command line, the one dispatcher: `python -m glm_lightning {fit,validate,test} --config configs/....yaml` runs a
stage (LightningCLI, `glm_lightning.stage_cli`), `demo` the end-to-end job behind `make demo`, `sweep` a study
(`docs/sweeps.md`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(args: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if args is None else args)
    if argv and argv[0] == "demo":
        from glm_lightning.demo import main as demo_main

        demo_main(argv[1:])
        return
    if argv and argv[0] == "sweep":
        from glm_lightning.sweep import main as sweep_main

        sweep_main(argv[1:])
        return
    from glm_lightning.stage_cli import build_cli

    build_cli(args)  # None -> LightningCLI reads sys.argv itself (no "args and argv" warning)


if __name__ == "__main__":
    main()
