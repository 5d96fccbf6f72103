"""Command line, the one dispatcher: `python -m glm_lightning {fit,validate,test} --config configs/....yaml` runs a
stage (LightningCLI, `glm_lightning.stage_cli`), `demo` the end-to-end job behind `make demo`, `sweep` a study
(`docs/sweeps.md`), `generate` samples from a trained checkpoint (`glm_lightning.generate_cli`).

Every command is imported only when it runs, so `python -m glm_lightning --help` answers at once. `main` raises
like a library; `run` (what `python -m glm_lightning` and the installed `glm-lightning` command call) turns a user
error into one line on stderr and exit status 2 (`GLM_DEBUG=1` shows the full traceback).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

STAGE_COMMANDS = ("fit", "validate", "test")
HELP = """usage: python -m glm_lightning COMMAND [options]

commands:
  fit        train a stage from YAML:  fit --config configs/pretrain.yaml [--trainer.max_steps 200 ...]
  validate   evaluate a checkpoint:    validate --config configs/rl.yaml --model.init_args.init_weights CKPT
  test       test a checkpoint:        test --config configs/vision.yaml --ckpt_path CKPT
  demo       the end-to-end job behind `make demo` (pre-training -> vision -> RL -> summary); --smoke, --dry-run
  sweep      a study of variants x seeds with paired statistics: sweep --config configs/experiments/ordering.yaml
  generate   try a trained model:      generate --ckpt CKPT [--prompt TEXT | --task FAMILY] [--num_samples N]
  export     a model to take away:     export --ckpt CKPT --out DIR  (safetensors + config.json + model card)

From Python: `import glm_lightning; glm_lightning.load(DIR_OR_CKPT).generate("def double(x):")`.

`python -m glm_lightning COMMAND --help` lists a command's options (`fit --help` every model and data knob).
"""


def main(args: Sequence[str] | None = None, exit_on_error: bool = True) -> None:
    argv = list(sys.argv[1:] if args is None else args)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(HELP, end="")
        return
    if argv[0] in ("--version", "-V", "version") or (argv[0] in STAGE_COMMANDS and "--version" in argv[1:]):
        from glm_lightning import __version__

        print(f"glm-lightning {__version__}")
        return
    if argv[0] == "export":
        from glm_lightning.export import main as export_main

        export_main(argv[1:])
        return
    if argv[0] == "demo":
        from glm_lightning.demo import main as demo_main

        demo_main(argv[1:])
        return
    if argv[0] == "sweep":
        from glm_lightning.sweep import main as sweep_main

        sweep_main(argv[1:])
        return
    if argv[0] == "generate":
        from glm_lightning.generate_cli import main as generate_main

        generate_main(argv[1:])
        return
    if argv[0] not in STAGE_COMMANDS and not argv[0].startswith("-"):
        raise SystemExit(f"error: unknown command {argv[0]!r}; choose one of "
                         f"{', '.join([*STAGE_COMMANDS, 'demo', 'sweep', 'generate', 'export'])} (see --help)")
    from glm_lightning.help_cache import cached_help, is_help_only

    if is_help_only(argv):  # the full option list without the imports, once built (glm_lightning/help_cache.py)
        def build() -> None:
            from glm_lightning.help_cache import keep_schema
            from glm_lightning.stage_cli import build_cli

            keep_schema()  # Lightning is imported now anyway: keep the config schema for fast key errors
            build_cli(argv, exit_on_error=exit_on_error)

        print(cached_help(argv, build), end="")
        return
    from glm_lightning.help_cache import cached_schema
    from glm_lightning.user_errors import check_config_files

    check_config_files(argv, cached_schema())  # empty / non-YAML / unknown top-level keys: one line before seconds of imports
    print(f"[glm-lightning] {argv[0]}: building the run (imports take a few seconds)", file=sys.stderr, flush=True)
    from glm_lightning.stage_cli import build_cli

    build_cli(args, exit_on_error=exit_on_error)  # None -> LightningCLI reads sys.argv (no "args and argv" warning)


def run(args: Sequence[str] | None = None) -> int:
    """`main` for people: a user error (bad value, missing file, unknown key) is one line on stderr, exit status 2."""
    from glm_lightning.user_errors import describe, is_user_error

    try:
        main(args, exit_on_error=False)
    except SystemExit as err:
        if err.code is None or isinstance(err.code, int):
            return err.code or 0
        message = str(err.code)
        print(message if message.startswith("error") else f"error: {message}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:
        if os.environ.get("GLM_DEBUG") or not err.name or err.name.split(".")[0] in ("glm_lightning", "callbacks",
                                                                                      "datamodules"):
            raise
        print(f"error: the package {err.name.split('.')[0]!r} is not installed for {sys.executable}: run `make venv` "
              "and use .venv/bin/python (or `source .venv/bin/activate`)", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - classified below; anything unexpected keeps its traceback
        if os.environ.get("GLM_DEBUG") or not is_user_error(err):
            raise
        print(f"error: {describe(err, list(sys.argv[1:] if args is None else args))}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(run())
