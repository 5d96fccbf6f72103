"""The project's LightningCLI: `build_cli` runs a stage (`fit`, `validate`, `test`) from YAML, and `check_config`
parses a config and instantiates its model, data, logger and callbacks without training (used by the sweep
validator and `tests/test_configs.py`, so a misspelt key fails before any run).

Every LightningModule / DataModule / callback of the project is imported here so configs may name them by class
name (`class_path: PretrainModule`); any LightningModule or LightningDataModule is accepted (subclass mode).

Every run also gets three callbacks whatever its config says (their settings sit under `last_checkpoint:`,
`preflight:` and `final_validation:`): `LastCheckpoint` keeps `checkpoints/last.ckpt` current (step schedule, end,
Ctrl-C, SIGTERM, errors), `Preflight` refuses, before the first step, configs that would fail or mislead later, and
`FinalValidation` evaluates a fit at its last step when its schedule would not (and warns before such a run). Resuming with
`--ckpt_path <log dir>/checkpoints/last.ckpt` continues in that same log directory (TensorBoard curves continue).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional, Union

os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")

import lightning.pytorch as pl  # noqa: E402
from jsonargparse import set_parsing_settings  # noqa: E402
from lightning.pytorch.cli import ArgsType, LightningCLI, SaveConfigCallback  # noqa: E402
from lightning.pytorch.utilities import rank_zero_info  # noqa: E402

import callbacks  # noqa: E402,F401  (registers callbacks for class_path lookup)
from callbacks.final_validation import FinalValidation  # noqa: E402
from callbacks.last_checkpoint import LastCheckpoint  # noqa: E402
from callbacks.preflight import Preflight, check_run  # noqa: E402
import datamodules  # noqa: E402,F401
import glm_lightning.modules  # noqa: E402,F401
from glm_lightning.modules.base import allow_checkpoint_globals  # noqa: E402
from glm_lightning.quiet import quiet_known_noise  # noqa: E402

CLI_DEFAULTS: dict[str, Any] = {"subclass_mode_model": True, "subclass_mode_data": True,
                                "seed_everything_default": 0, "auto_configure_optimizers": False}
STAGE_COMMANDS = ("fit", "validate", "test")
NO_ABBREVIATIONS = {"allow_abbrev": False, **{command: {"allow_abbrev": False} for command in STAGE_COMMANDS}}
"""Parser settings: `--trainer.max_step 10` is a misspelt key (an error naming `max_steps`), never an abbreviation
of it; the subcommands' parsers take their own settings, hence one entry per command."""
LIGHTNING_CKPT_PATHS = ("best", "last", "hpc", "registry")
"""`ckpt_path` values Lightning resolves itself (no file to check)."""


class SaveConfigNextToLogs(SaveConfigCallback):
    """Writes config.yaml into the run's log directory; a run without a logger has none, and writes nothing (instead
    of a stray config.yaml in the working directory, e.g. the repository root)."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.logger is None:
            return
        super().setup(trainer, pl_module, stage)


class GLMCLI(LightningCLI):
    """LightningCLI with project defaults: seed 0, config saved next to the logs (overwritten on re-runs), the
    always-on `LastCheckpoint` and `Preflight` callbacks, resume into the checkpoint's own log directory."""

    _help_wanted = False

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_lightning_class_args(LastCheckpoint, "last_checkpoint")
        parser.add_lightning_class_args(Preflight, "preflight")
        parser.add_lightning_class_args(FinalValidation, "final_validation")
        parser.add_argument("--threads", type=Optional[Union[int, str]], default=None,
                            help="intra-op threads: N fixes the count; default every core of this machine "
                                 "(OMP_NUM_THREADS when set); 'auto' the cores idle at start (load-dependent). "
                                 "Seed + CPU kind + threads fix a run's result")
        if self._help_wanted:
            parser.epilog = knobs_help()
            parser.formatter_class = _RawEpilogFormatter(parser.formatter_class)


    def _parse_ckpt_path(self) -> None:
        """`--ckpt_path` resumes (or evaluates) the run this command describes: the file must be a glm-lightning
        checkpoint of the same model config, else a one-line error (as `init_weights` gives). LightningCLI's own
        version instead let the checkpoint's hyperparameters replace the config's, so a checkpoint of another model
        silently switched the run to that model."""
        command = self.config.get("subcommand")
        if not command:
            return
        config = self.config[command]
        check_ckpt_path(config.get("ckpt_path"), config.get("model"))
        if "weights_only" in config and config["weights_only"] is None:  # the allow-list holds what we save
            config["weights_only"] = True

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        if config is not None and config.get("ckpt_path"):
            resume_into_same_run(config)
            from glm_lightning.quiet import quiet_resume_noise

            quiet_resume_noise()
        if config is not None:
            drop_progress_bars_when_disabled(config)
            plain_progress_off_terminal(config)
            summary_without_zero_flops(config)
        choose_run_threads(config.get("threads") if config is not None else None)

    def after_instantiate_classes(self) -> None:
        super().after_instantiate_classes()
        record_machine(self.trainer, self.model)
        from glm_lightning.help_cache import keep_schema

        keep_schema()  # once per code version: the next command's config-key errors need no Lightning import
        from glm_lightning import precision

        precision.log_start(self.trainer.precision, "training")


def choose_run_threads(spec: int | str | None = None) -> int:
    """Set torch's intra-op threads for this run from `--threads` (`glm_lightning.threads.resolve_threads`: N, the
    machine's cores by default, OMP_NUM_THREADS when set, or 'auto'), say how it was chosen, warn when other processes
    keep those cores busy; returns the count set."""
    from glm_lightning.threads import busy_warning, resolve_threads, use_threads

    n, how = resolve_threads(spec)
    use_threads(n)
    rank_zero_info(f"[threads] {n} intra-op thread{'s' if n != 1 else ''}: {how}")
    if spec is None:  # a count the user chose (N, auto) or the demo passed on is not second-guessed
        warning = busy_warning(n)
        if warning:
            rank_zero_info(f"[threads] warning: {warning}")
    return n


def record_machine(trainer: pl.Trainer, model: Any) -> dict[str, Any]:
    """Say and record what fixes this run besides its seed: the CPU kind, torch's CPU capability, the thread count
    and versions (`glm_lightning.machine`). They go into the logger's hyperparameters (hparams.yaml, beside the
    stage's own), the module (`model.machine`: every checkpoint and the final HPARAMS entry carry it)."""
    from glm_lightning.machine import describe, machine_info

    info = machine_info()  # torch's thread count as set, not as asked for
    rank_zero_info(f"[machine] {describe(info)} (seed + CPU kind + threads fix a run's result)")
    if model is not None:
        model.machine = info
    if trainer is not None and trainer.logger is not None and trainer.global_rank == 0:
        trainer.logger.log_hyperparams({"machine": info})
    return info


def check_ckpt_path(ckpt_path: Any, model: Any) -> None:
    """Raise a one-line error unless `ckpt_path` (a Lightning keyword such as `last` aside) is a full glm-lightning
    checkpoint of this command's stage and of the model config the parsed `model` section (class_path + init_args)
    builds: another stage's checkpoint names both stages, a weights-only copy names the full checkpoint it came from."""
    if not ckpt_path or str(ckpt_path) in LIGHTNING_CKPT_PATHS or "://" in str(ckpt_path):
        return
    from glm_lightning.run_record import STAGE_NAMES, checkpoint_record
    from glm_lightning.model import GLMConfig
    from glm_lightning.modules.base import STAGE_OF_MODULE, check_same_model, load_checkpoint_file

    ckpt = load_checkpoint_file(ckpt_path)
    class_path = str(model.get("class_path", "")) if hasattr(model, "get") else ""
    mine = class_path.rpartition(".")[2]
    theirs = checkpoint_record(ckpt).get("stage")
    if theirs and mine in STAGE_NAMES and theirs != mine:
        stage = STAGE_OF_MODULE.get(theirs, "")
        raise ValueError(f"{ckpt_path} is a {STAGE_NAMES.get(theirs, theirs)} checkpoint ({theirs}) and this command "
                         f"runs {STAGE_NAMES[mine]} ({mine}): resume it with its own stage config "
                         f"(configs/{stage}.yaml), or start this stage from its weights with "
                         f"--model.init_args.init_weights {ckpt_path}")
    if ckpt.get("weights_only_of") is not None:
        raise ValueError(f"{ckpt_path} holds weights only (no optimizer state, for init_weights, generate and export): "
                         f"resume from the full checkpoint {ckpt['weights_only_of']}, or start from these weights "
                         f"with --model.init_args.init_weights {ckpt_path}")
    init = model.get("init_args") if hasattr(model, "get") else None
    if init is None or init.get("preset") is None:
        return
    mine_cfg = GLMConfig.preset(init.get("preset"), **dict(init.get("model_overrides") or {}))
    check_same_model(ckpt_path, GLMConfig(**ckpt["glm_config"]), mine_cfg, STAGE_OF_MODULE.get(mine))


def drop_progress_bars_when_disabled(config: Any) -> None:
    """`--trainer.enable_progress_bar false` on a config that lists a progress bar (pretrain.yaml's RichProgressBar)
    would stop Lightning with a conflict; the flag is the user's latest word, so the bar is left out instead."""
    trainer = config.get("trainer") or {}
    callbacks = trainer.get("callbacks")
    if trainer.get("enable_progress_bar") is not False or not isinstance(callbacks, list):
        return
    trainer["callbacks"] = [cb for cb in callbacks
                            if not class_path_of(cb).endswith("ProgressBar")]


def class_path_of(entry: Any) -> str:
    """The `class_path` of a parsed callback entry ("" for anything else)."""
    return str(entry.get("class_path", "")) if hasattr(entry, "get") else ""


PLAIN_PROGRESS = "callbacks.progress.PlainProgressBar"


def plain_progress_off_terminal(config: Any, is_terminal: bool | None = None) -> bool:
    """When stdout is not a terminal (a pipe, a file, CI; `GLM_PROGRESS=plain` forces it, `=rich` keeps the bar), the
    configured progress bar, which would print nothing until the end there, becomes `PlainProgressBar` (a plain
    line at a steady interval). Returns whether it swapped."""
    import sys

    from jsonargparse import Namespace

    forced = os.environ.get("GLM_PROGRESS", "").strip().lower()
    plain = forced == "plain" or (forced != "rich" and not (sys.stdout.isatty() if is_terminal is None
                                                            else is_terminal))
    trainer = config.get("trainer") or {}
    if not plain or trainer.get("enable_progress_bar") is False or trainer.get("fast_dev_run"):
        return False
    entries = trainer.get("callbacks")
    entries = [] if entries is None else entries
    if not isinstance(entries, list):
        return False
    bars = [cb for cb in entries if class_path_of(cb).endswith("ProgressBar")]
    for cb in bars:
        cb["class_path"] = PLAIN_PROGRESS
        cb["init_args"] = Namespace()
    if not bars:
        entries.append(Namespace(class_path=PLAIN_PROGRESS, init_args=Namespace()))
        trainer["callbacks"] = entries
    return True


def summary_without_zero_flops(config: Any) -> None:
    """Every run that shows a model summary shows `callbacks.summary.ParamsSummary` (no "Total FLOPs: 0"), unless
    its config lists a summary callback of its own."""
    from jsonargparse import Namespace

    trainer = config.get("trainer") or {}
    entries = trainer.get("callbacks")
    entries = [] if entries is None else entries
    if trainer.get("enable_model_summary") is False or trainer.get("fast_dev_run") or not isinstance(entries, list):
        return
    if any(class_path_of(cb).endswith("ModelSummary") for cb in entries):
        return
    entries.append(Namespace(class_path="callbacks.summary.ParamsSummary", init_args=Namespace()))
    trainer["callbacks"] = entries


def resume_into_same_run(config: Any) -> None:
    """When `ckpt_path` is `<save_dir>/<name>/version_K/checkpoints/*.ckpt` of this config's TensorBoard logger
    (and no version is set), log into version_K again instead of a new version_K+1."""
    logger = config.get("trainer", {}).get("logger")
    if not hasattr(logger, "get") or "TensorBoardLogger" not in str(logger.get("class_path", "")):
        return
    init = logger.get("init_args")
    if init is None or init.get("version") is not None:
        return
    ckpt = Path(str(config["ckpt_path"])).resolve()
    run_dir = ckpt.parent.parent
    name = init.get("name")
    expected = Path(str(init.get("save_dir", "lightning_logs")), *(() if name in (None, "") else (str(name),)))
    if ckpt.parent.name == "checkpoints" and run_dir.name.startswith("version_") and \
            run_dir.parent == expected.resolve():
        init["version"] = run_dir.name


def _RawEpilogFormatter(base: Any) -> Any:  # noqa: N802 - a class factory
    class Formatter(base):
        def _fill_text(self, text: str, width: int, indent: str) -> str:
            return text  # keep the knob list's line breaks

    return Formatter


def knobs_help() -> str:
    """Every model and data knob of the project's stages and datamodules, with its docstring, for `fit --help`
    (in subclass mode LightningCLI lists them only per class, with `--model.help CLASS`)."""
    import inspect
    import textwrap

    import docstring_parser

    from datamodules import CodeCorpusDataModule, DigitsDataModule, RLPromptDataModule
    from glm_lightning.modules import PretrainModule, RLModule, StageModule, VisionModule

    out = ["model and data knobs (set them with --model.init_args.KEY / --data.init_args.KEY, or in YAML):"]
    for section, classes in (("model", (PretrainModule, VisionModule, RLModule, StageModule)),
                             ("data", (CodeCorpusDataModule, DigitsDataModule, RLPromptDataModule))):
        for cls in classes:
            shared = " (every stage)" if cls is StageModule else ""
            out.append(f"\n  {section}: {cls.__module__}.{cls.__name__}{shared}")
            docs = {p.arg_name: p.description for doc in (cls.__doc__, cls.__init__.__doc__)
                    for p in docstring_parser.parse(doc or "").params}
            for name in inspect.signature(cls.__init__).parameters:
                if name in ("self", "kwargs", "args") or (cls is not StageModule and name in SHARED_STAGE_ARGS):
                    continue
                text = " ".join((docs.get(name) or "(no description)").split())
                out.append(textwrap.fill(f"{name}: {text}", width=118, initial_indent="    ",
                                         subsequent_indent="        "))
    return "\n".join(out)


SHARED_STAGE_ARGS = ("preset", "model_overrides", "lr", "min_lr_ratio", "weight_decay", "betas", "warmup_steps")


def _wants_help(args: ArgsType) -> bool:
    argv = sys.argv[1:] if args is None else args
    return isinstance(argv, list) and any(a in ("-h", "--help") or str(a).endswith(".help") for a in argv)


def build_cli(args: ArgsType = None, run: bool = True, exit_on_error: bool = True) -> GLMCLI:
    """The stage CLI; `args=None` reads sys.argv, `run=False` only builds the trainer, model and data;
    `exit_on_error=False` raises parse errors (for `cli.run`'s one-line messages) instead of printing the usage."""
    # settings dataclasses (e.g. RLModule's `sampling`) document their fields in attribute docstrings; parsing those
    # makes every parse ~5x slower, so only --help pays for it
    help_wanted = _wants_help(args)
    if help_wanted:
        set_parsing_settings(docstring_parse_attribute_docstrings=True)
    GLMCLI._help_wanted = help_wanted
    allow_checkpoint_globals()
    quiet_known_noise()
    try:
        return GLMCLI(pl.LightningModule, pl.LightningDataModule, save_config_callback=SaveConfigNextToLogs,
                      save_config_kwargs={"overwrite": True}, args=args, run=run,
                      parser_kwargs={"exit_on_error": exit_on_error, **NO_ABBREVIATIONS}, **CLI_DEFAULTS)
    finally:
        GLMCLI._help_wanted = False
        if help_wanted:
            set_parsing_settings(docstring_parse_attribute_docstrings=False)


class _ParseOnly(GLMCLI):
    """Builds the parser only; `check_config` does the parsing and instantiation itself (no run: the thread count of
    the checking process, e.g. a sweep's driver, is left alone)."""

    def parse_arguments(self, parser: Any, args: Any) -> None:
        from jsonargparse import Namespace

        self.config = Namespace()

    def _set_seed(self) -> None:
        pass

    def before_instantiate_classes(self) -> None:
        pass

    def instantiate_classes(self) -> None:
        pass

    def after_instantiate_classes(self) -> None:
        pass


class _ParserOnly(GLMCLI):
    """Builds the parser with its subcommands (`fit`, `validate`, `test`) and stops: `parse_command` parses."""

    def parse_arguments(self, parser: Any, args: Any) -> None:
        from jsonargparse import Namespace

        self.config = Namespace(subcommand=None)

    def _set_seed(self) -> None:
        pass

    def before_instantiate_classes(self) -> None:
        pass

    def instantiate_classes(self) -> None:
        pass

    def after_instantiate_classes(self) -> None:
        pass


@functools.lru_cache(maxsize=1)
def _command_parser() -> Any:
    quiet_known_noise()
    return _ParserOnly(pl.LightningModule, pl.LightningDataModule, run=True, args=[],
                       parser_kwargs={"exit_on_error": False, **NO_ABBREVIATIONS}, **CLI_DEFAULTS).parser


def parse_command(args: Sequence[str]) -> Any:
    """Parse a whole stage command (`["fit", "--config", "configs/pretrain.yaml", ...]`) as `python -m glm_lightning`
    would, instantiating nothing (checkpoints and start weights are not read); raises on a bad key, value or file.
    The parser is built once per process (tests/test_docs_commands.py parses every documented command with it)."""
    return _command_parser().parse_args(list(args))


@functools.lru_cache(maxsize=1)
def _checker() -> Callable[[list[str]], None]:
    allow_checkpoint_globals()
    quiet_known_noise()
    cli = _ParseOnly(pl.LightningModule, pl.LightningDataModule, run=False,
                     parser_kwargs={"exit_on_error": False, **NO_ABBREVIATIONS}, args=[], **CLI_DEFAULTS)

    def check(args: list[str]) -> None:
        cfg = cli.parser.parse_args(args)
        cli.config = cfg  # the module instantiators dump cli.config into the modules' hparams
        cli.__dict__.pop("config_dump", None)
        init = cli.parser.instantiate_classes(cfg)
        check_run(init.get("model"), init.get("data"), list(init.get("trainer", {}).get("callbacks") or []))

    return check


def check_config(args: Sequence[str]) -> None:
    """Parse stage arguments (e.g. `["--config", "configs/rl.yaml", "--trainer.max_steps=3"]`) with the real CLI
    parser (built once per process) and instantiate model, data, logger and callbacks, never the Trainer, then run the
    preflight checks (`callbacks.preflight.check_run`); raises on a bad key or value."""
    _checker()(list(args))
