"""Every `python -m glm_lightning ...` command written in the README, docs/ and the configs' comments parses as
written (stage commands with the real CLI parser, instantiating nothing; `demo`, `generate`, `export` and `sweep`
with their own parsers, a sweep's study file loaded), and every checkpoint path they name is one a documented command
writes."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
MODULE = "python -m glm_lightning"
SOURCES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "configs").rglob("*.yaml")])
STALE: dict[str, str] = {}
"""Files whose commands are known not to parse any more, with why; each must still fail (strict xfail), so a fix
removes its entry here."""


def _lines(path: Path) -> list[str]:
    """The file's lines; in a YAML file only its comments (a command is documented there as `#   python -m ...`)."""
    lines = path.read_text().splitlines()
    if path.suffix == ".yaml":
        lines = [ln.split("#", 1)[1] if "#" in ln else "" for ln in lines]
    return lines


def documented_commands(path: Path) -> list[str]:
    """The commands of one file, each on one line: from `python -m glm_lightning` to the end of the inline code
    (a backtick or quote), a shell comment, or the line (continued over lines ending in a backslash)."""
    lines = _lines(path)
    variables = dict(m.groups() for ln in lines if (m := re.match(r"^\s*([A-Z][A-Z_]*)=(.*)$", ln)))
    out = []
    for i, line in enumerate(lines):
        for found in re.finditer(re.escape(MODULE) + r"(?=\s|`|$)", line):
            text, j = line[found.end():], i
            in_code = line[:found.start()].count("`") % 2 == 1
            while j + 1 < len(lines) and (text.rstrip().endswith("\\") or (in_code and "`" not in text)):
                j += 1  # a shell continuation, or inline code that goes on on the next line
                text = text.rstrip().removesuffix("\\") + " " + lines[j].strip()
            text = re.split(r"`|\s#|\"\s*[,)]?$", text)[0]
            for name, value in variables.items():
                text = text.replace(f"${name}", value.strip().strip('"'))
            out.append(text.strip())
    return out


def _runnable(command: str) -> bool:
    """A command, not prose about commands: `python -m glm_lightning ...`, `fit|validate|test`, `<study>` templates,
    a bare command name in a sentence ("`python -m glm_lightning sweep`) would settle it")."""
    if not command or re.search(r"\.\.\.|<[^>]*>|\||^[A-Z]", command) or "$" in command:
        return False
    return len(command.split()) > 1 or command in ("demo", "--help")


def _cases() -> list:
    cases = []
    for path in SOURCES:
        rel = str(path.relative_to(ROOT))
        commands = [c for c in documented_commands(path) if _runnable(c)]
        if commands:
            marks = [pytest.mark.xfail(strict=True, reason=STALE[rel])] if rel in STALE else []
            cases.append(pytest.param(rel, commands, id=rel, marks=marks))
    return cases


_SCHEMA: list[dict] = []


def _schema() -> dict:
    """The config schema `make venv` caches (built once per test process)."""
    if not _SCHEMA:
        from glm_lightning.help_cache import build_schema

        _SCHEMA.append(build_schema())
    return _SCHEMA[0]


def parse_documented(command: str) -> None:
    """Parse one command (its arguments after `python -m glm_lightning`); raise if it would not start."""
    args = [a.strip("[]") for a in shlex.split(command)]
    if args[0] in ("fit", "validate", "test"):
        from glm_lightning.stage_cli import parse_command
        from glm_lightning.user_errors import check_config_files

        check_config_files(args[1:], _schema())  # the fast checks before the imports accept it too
        parse_command(args)
    elif args[0] == "demo":
        from glm_lightning.demo import build_parser

        build_parser().parse_args(args[1:])
    elif args[0] == "generate":
        from glm_lightning.generate_cli import build_parser as generate_parser

        generate_parser().parse_args(args[1:])
    elif args[0] == "export":
        from glm_lightning.export import build_parser as export_parser

        export_parser().parse_args(args[1:])
    elif args[0] == "sweep" and args[1:2] != ["findings"]:
        from glm_lightning.sweep.cli import build_parser as sweep_parser
        from glm_lightning.sweep.study import load_study

        parsed = sweep_parser().parse_args(args[1:])
        load_study(parsed.config, seeds=parsed.seeds)
    elif args[0] == "sweep":
        assert set(args[2:]) <= {"--runs", "--data", "--out", "--studies"} or len(args) == 2, command
    else:
        raise AssertionError(f"unknown command {args[0]!r}")


PARSED: dict[str, str | None] = {}
"""Each distinct command parsed once per session (many files repeat the README's): command -> error or None."""


def parse_once(command: str) -> str | None:
    if command not in PARSED:
        try:
            parse_documented(command)
            PARSED[command] = None
        except SystemExit as err:  # --help and --print_config exit 0 after printing
            PARSED[command] = None if err.code in (0, None) else f"SystemExit: {err.code}"
        except Exception as err:  # noqa: BLE001 - collected, all reported at once
            PARSED[command] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
    return PARSED[command]


@pytest.mark.parametrize("path, commands", _cases())
def test_every_documented_command_parses(path, commands, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the docs give paths relative to the repository root
    failures = [f"{MODULE} {c}\n    -> {error}" for c in commands if (error := parse_once(c))]
    capsys.readouterr()  # the help texts
    assert not failures, f"{path}: {len(failures)} of {len(commands)} commands do not parse:\n" + "\n".join(failures)


def test_the_extraction_finds_the_readmes_commands():
    """The test above would pass vacuously if extraction broke: the README's own examples must be found."""
    found = documented_commands(ROOT / "README.md")
    for expected in ("fit --config configs/pretrain.yaml --model.init_args.lr 1e-3 --print_config",
                     "demo --stages pretrain", "generate --ckpt lightning_logs/demo/rl.ckpt --prompt 'def double(x):'"):
        assert expected in found
    assert sum(_runnable(c) for c in found) >= 20


def written_checkpoints() -> list[tuple[re.Pattern, int]]:
    """Checkpoint paths the documented commands write, as (pattern, step interval; 0 = any): each config's
    `<save_dir>/<name>/version_K/checkpoints/last.ckpt` and `every/stepN.ckpt` (N a multiple of its ModelCheckpoint's
    every_n_train_steps), and the demo's copies."""
    patterns = [(re.compile(r"lightning_logs/(?:smoke/)?demo/(?:pretrain|vision|rl)\.ckpt"), 0)]
    for path in (ROOT / "configs").rglob("*.yaml"):
        trainer = (yaml.safe_load(path.read_text()) or {}).get("trainer") or {}
        logger = trainer.get("logger")
        init = (logger.get("init_args") or {}) if isinstance(logger, dict) else {}
        if not init.get("name"):
            continue
        run = re.escape(f"{init.get('save_dir', 'lightning_logs')}/{init['name']}") + r"/version_\d+/checkpoints/"
        patterns.append((re.compile(run + r"last\.ckpt"), 0))
        for cb in trainer.get("callbacks") or []:
            args = (cb.get("init_args") or {}) if isinstance(cb, dict) else {}
            if str(args.get("filename", "")).startswith("every/step{step}") and args.get("every_n_train_steps"):
                patterns.append((re.compile(run + r"every/step(\d+)\.ckpt"), int(args["every_n_train_steps"])))
    return patterns


def is_written(path: str, patterns: list[tuple[re.Pattern, int]]) -> bool:
    return any((m := pattern.fullmatch(path)) and (not every or int(m.group(1)) % every == 0)
               for pattern, every in patterns)


@pytest.mark.parametrize("doc", ["README.md", "docs/rl.md", "docs/sweeps.md", "docs/verifier.md", "docs/performance.md",
                                 "docs/results/rl.md"])
def test_every_checkpoint_path_in_the_guides_is_written_by_a_documented_command(doc):
    patterns = written_checkpoints()
    named = set(re.findall(r"lightning_logs/[\w./-]+?\.ckpt", (ROOT / doc).read_text()))
    assert not [p for p in sorted(named) if not is_written(p, patterns)], named


def test_a_checkpoint_no_command_writes_is_caught():
    patterns = written_checkpoints()
    assert is_written("lightning_logs/pretrain/version_0/checkpoints/every/step80.ckpt", patterns)
    assert not is_written("lightning_logs/pretrain/version_0/checkpoints/every/step100.ckpt", patterns)
    assert not is_written("lightning_logs/nosuch/version_0/checkpoints/last.ckpt", patterns)


def test_the_rl_studies_quick_mode_logs_their_metrics(tmp_path, monkeypatch):
    """The README's quick mode for the RL studies (`--set trainer.limit_train_batches=1 --set
    data.init_args.eval_per_family=2`) ends the epoch, so the run logs the metrics the studies compare (with
    `trainer.max_steps=1` it logged none). Random start weights and short completions keep the run small."""
    from glm_lightning.cli import run
    from glm_lightning.sweep.events import read_scalars

    readme = (ROOT / "README.md").read_text()
    quick = ["trainer.limit_train_batches=1", "data.init_args.eval_per_family=2"]
    assert all(f"--set {setting}" in readme for setting in quick)
    study = yaml.safe_load((ROOT / "configs" / "experiments" / "rl_reward.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    args = [f"--{setting}" for setting in quick] + [
        "--model.init_args.init_weights", "null", "--model.init_args.sampling.max_new_tokens", "8",
        "--trainer.callbacks.max_new_tokens", "8", "--trainer.enable_checkpointing", "false"]
    assert run(["fit", "--config", str(ROOT / "configs" / "experiments" / study["base"]), *args]) == 0
    logged = read_scalars(next(tmp_path.rglob("events.out.tfevents.*")).parent)
    assert {m["tag"] for m in study["metrics"]} <= set(logged)


def test_the_readmes_parameter_counts_are_current():
    """The README quotes flash-25m's size; the model's own count keeps it current."""
    import torch

    from glm_lightning.model import GLMConfig, GLMModel

    with torch.device("meta"):
        counts = GLMModel(GLMConfig.preset("flash-25m")).num_parameters()
    quoted = re.search(r"([\d.]+)M parameters, ([\d.]+)M active per token", (ROOT / "README.md").read_text())
    assert quoted, "the README's flash-25m size line moved"
    assert quoted.groups() == (f"{counts['total'] / 1e6:.1f}", f"{counts['active'] / 1e6:.1f}")
