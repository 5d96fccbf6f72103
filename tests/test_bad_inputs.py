"""Bad inputs get one clear line, never a stack trace from deep inside: `python -m glm_lightning ...` (`cli.run`)
prints `error: <what is wrong and what to change>` and exits with status 2; the public model APIs raise a ValueError
that names the expected shape or range."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from glm_lightning.cli import run
from glm_lightning.model import GLMConfig, GLMModel

CONF = Path(__file__).parent / "conf"
TINY = str(CONF / "pretrain_tiny.yaml")
RL_TINY = str(CONF / "rl_tiny.yaml")
ROOT = Path(__file__).resolve().parent.parent
README = str(ROOT / "README.md")


def _save(path: Path, preset: str, **overrides: object) -> str:
    cfg = GLMConfig.preset(preset, **overrides)
    state = {f"model.{k}": v for k, v in GLMModel(cfg).state_dict().items()}
    torch.save({"glm_config": cfg.to_dict(), "state_dict": state}, path)
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:  # noqa: ANN001
    tmp = tmp_path_factory.mktemp("bad_inputs")
    torch.manual_seed(0)
    typo = tmp / "typo.yaml"
    typo.write_text(Path(TINY).read_text().replace("    lr: 3.0e-3", "    lrr: 3.0e-3"))
    no_start = tmp / "rl_no_start.yaml"
    no_start.write_text("".join(line for line in Path(RL_TINY).read_text().splitlines(keepends=True)
                                if "init_weights" not in line))
    (tmp / "empty.yaml").write_text("")
    (tmp / "trainer_typo.yaml").write_text("trainer: {max_stepz: 10}\n")
    (tmp / "section_typo.yaml").write_text("trainr: {max_steps: 10}\n")
    (tmp / "a_list.yaml").write_text("- trainer\n")
    (tmp / "bad.yaml").write_text("trainer: {max_steps: 10\n")
    not_glm = tmp / "not_glm.ckpt"
    torch.save({"state_dict": {}}, not_glm)
    return {"tiny": _save(tmp / "tiny.ckpt", "tiny", max_seq_len=192),
            "other": _save(tmp / "other.ckpt", "tiny", max_seq_len=192, d_model=48),
            "demo": _save(tmp / "demo.ckpt", "demo"),
            **{name: str(tmp / f"{name}.yaml") for name in ("empty", "trainer_typo", "section_typo", "a_list", "bad")},
            "typo": str(typo), "no_start": str(no_start), "not_glm": str(not_glm), "logs": str(tmp / "logs"),
            "folder": str(tmp)}


def _fit(*extra: str, config: str = TINY) -> list[str]:
    return ["fit", "--config", config, "--trainer.max_steps", "1", "--trainer.logger", "false", *extra]


CASES = {
    # checkpoints
    "generate: not a checkpoint": (["generate", "--ckpt", README], "is not a checkpoint"),
    "generate: missing checkpoint": (["generate", "--ckpt", "no/such.ckpt"], "checkpoint not found"),
    "generate: not a glm checkpoint": (["generate", "--ckpt", "@not_glm"], "not a glm-lightning checkpoint"),
    "fit: init_weights is not a checkpoint": (_fit("--model.init_args.init_weights", README), "is not a checkpoint"),
    "fit: init_weights of another model config": (_fit("--model.init_args.init_weights", "@other"),
                                                  "different model config"),
    "fit: ckpt_path of another model config": (_fit("--ckpt_path", "@other"), "different model config"),
    "fit: ckpt_path is not a checkpoint": (_fit("--ckpt_path", README), "README.md is not a checkpoint"),
    "fit: ckpt_path is a folder": (_fit("--ckpt_path", "@folder"), "is a folder, not a checkpoint file"),
    "fit: ckpt_path does not exist": (_fit("--ckpt_path", "no/such.ckpt"), "checkpoint not found: no/such.ckpt"),
    "generate: ckpt is a folder": (["generate", "--ckpt", "@folder"], "is a folder but not a glm-lightning export"),
    # prompts and sequences
    "generate: empty prompt": (["generate", "--ckpt", "@tiny", "--prompt", ""], "prompt is empty"),
    "generate: blank prompt": (["generate", "--ckpt", "@tiny", "--prompt", "   "], "prompt is empty"),
    "generate: prompt longer than the context": (["generate", "--ckpt", "@tiny", "--prompt", "x" * 400],
                                                 "context is 192"),
    "generate: prompt and task together": (["generate", "--ckpt", "@tiny", "--prompt", "def f(x):", "--task",
                                            "increment"], "either --prompt or --task"),
    "generate: zero new tokens": (["generate", "--ckpt", "@tiny", "--prompt", "a", "--max_new_tokens", "0"],
                                  "--max_new_tokens must be >= 1"),
    "generate: zero samples": (["generate", "--ckpt", "@tiny", "--prompt", "a", "--num_samples", "0"],
                               "--num_samples must be >= 1"),
    "generate: negative temperature": (["generate", "--ckpt", "@tiny", "--prompt", "a", "--temperature", "-1"],
                                       "--temperature must be >= 0"),
    # presets and families
    "generate: unknown family": (["generate", "--ckpt", "@tiny", "--task", "nosuch"], "nosuch"),
    "fit: unknown preset": (_fit("--model.init_args.preset", "huge"), "unknown preset 'huge'"),
    "fit: unknown family": (_fit("--data.init_args.families", "[nosuch]"), "unknown task family 'nosuch'"),
    # config keys
    "fit: misspelt trainer key": (_fit("--trainer.max_stepz", "3"), "did you mean 'trainer.max_steps'"),
    "fit: misspelt model key": (_fit("--model.init_args.warmup_stepz", "3"),
                                "did you mean 'model.init_args.warmup_steps'"),
    "fit: misspelt key in the YAML file": (_fit(config="@typo"), "did you mean 'model.init_args.lr'"),
    "fit: misspelt trainer key in a YAML file names the file": (
        ["fit", "--config", TINY, "--config", "@trainer_typo"], "'trainer.max_stepz' in "),
    "fit: the YAML typo gets a suggestion": (["fit", "--config", TINY, "--config", "@trainer_typo"],
                                             "did you mean 'trainer.max_steps'"),
    "fit: misspelt section in a YAML file": (["fit", "--config", "@section_typo"], "did you mean 'trainer'?"),
    "fit: empty YAML file": (["fit", "--config", "@empty"], "is empty: a config file is a YAML mapping"),
    "fit: YAML file that is a list": (["fit", "--config", "@a_list"], "is not a YAML mapping"),
    "fit: YAML syntax error": (["fit", "--config", "@bad"], "is not valid YAML at line"),
    "fit: a demo checkpoint with the full-size stage config": (
        ["fit", "--config", str(ROOT / "configs" / "rl.yaml"), "--model.init_args.init_weights", "@demo",
         "--trainer.logger", "false"], "add its overlay (--config configs/demo/rl.yaml)"),
    "demo: dry run checks the values": (["demo", "--dry-run", "--max-steps", "-5"], "--max-steps must be >= 1"),
    "fit: missing config file": (["fit", "--config", "no/such.yaml"], "does not exist"),
    "fit: abbreviated key": (_fit("--trainer.max_step", "3"), "unknown config key 'trainer.max_step'; did you mean "
                                                               "'trainer.max_steps'?"),
    "fit: value of the wrong type": (_fit("--data.init_args.batch_size", "1.5"),
                                     "data.init_args.batch_size: expected int, got '1.5'"),
    "fit: misspelt model_overrides field": (_fit("--model.init_args.model_overrides", "{d_modl: 64}"),
                                            "unknown GLMConfig field(s) ['d_modl']; did you mean 'd_model'?"),
    "fit: YAML mapping without spaces": (_fit("--model.init_args.model_overrides", "{d_model:64}"),
                                         "a mapping needs a space after each colon"),
    "fit: an overlay alone": (["fit", "--config", str(ROOT / "configs" / "vision_direct.yaml")],
                              "is it an overlay? Give its base config first"),
    "fit: a demo overlay alone": (["fit", "--config", str(ROOT / "configs" / "demo" / "pretrain.yaml")],
                                  "is it an overlay?"),
    # configs that would fail late or silently
    "fit: monitored key never logged": (_fit("--trainer.callbacks+=ModelCheckpoint",
                                             "--trainer.callbacks.monitor=val/dev_pass",
                                             "--model.init_args.dev_eval=false", "--trainer.logger", "true"),
                                        "model.init_args.dev_eval is false"),
    "fit: data longer than the context": (_fit("--model.init_args.model_overrides", "{max_seq_len: 64}"),
                                          "set `model.init_args.model_overrides: {max_seq_len: 192}`"),
    "fit: freeze pattern matches nothing": (_fit("--trainer.callbacks+=callbacks.freeze.FreezeCallback",
                                                 "--trainer.callbacks.train=[model.blocks.11.*]", config=RL_TINY),
                                            "closest names: model.blocks.1.*"),
    "fit: continuing stage without init_weights": (_fit(config="@no_start"), "init_weights is not set"),
    "fit: the start-weights hint names the same model": (_fit(config="@no_start"),
                                                         "(preset 'tiny' with model_overrides {'max_seq_len': 192})"),
    # commands
    "unknown command": (["frobnicate"], "unknown command 'frobnicate'"),
    "demo: broken chain": (["demo", "--stages", "vision,rl"], "prefix"),
    "sweep: --set without a value": (["sweep", "--config", str(CONF / "sweep_tiny.yaml"), "--dry-run", "--set",
                                      "trainer.max_steps"], "KEY=VALUE"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cli_bad_input_is_one_clear_line(name, files, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    loggers = [logging.getLogger(), *(lg for lg in logging.root.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    for handler in (h for lg in loggers for h in lg.handlers):  # handlers bound to an earlier test's capture
        if type(handler) is logging.StreamHandler:
            monkeypatch.setattr(handler, "stream", sys.stderr)
    argv, expected = CASES[name]
    rc = run([files[a[1:]] if a.startswith("@") else a for a in argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert lines and "error" in lines[-1].lower() and expected in lines[-1], err[-2000:]
    assert not [p for p in tmp_path.iterdir() if p.name != "lightning_logs"], "a failed command wrote files"


@pytest.mark.parametrize("ids, message", [
    (torch.tensor([[1, 999]]), "token ids must lie in"),
    (torch.tensor([[-1, 5]]), "token ids must lie in"),
    (torch.zeros(3, dtype=torch.long), "shape [B, T]"),
    (torch.zeros(1, 3), "integer token ids"),
])
def test_model_rejects_bad_token_ids(ids, message):
    model = GLMModel(GLMConfig.preset("tiny"))
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        model.check_ids(ids)


@pytest.mark.parametrize("shape", [(1, 0), (0, 4)])
def test_empty_sequence_is_a_clear_error_in_forward_and_generate(shape):
    from glm_lightning.generation import generate

    model = GLMModel(GLMConfig.preset("tiny"))
    ids = torch.zeros(shape, dtype=torch.long)
    with pytest.raises(ValueError, match="is empty"):
        model(ids)
    with pytest.raises(ValueError, match="is empty"):
        generate(model, ids, max_new_tokens=2)


@pytest.mark.parametrize("shape, message", [((2, 1, 7, 7), "must be 8x8"), ((2, 3, 8, 8), "1 channels"),
                                            ((1, 8, 8), "4D tensor")])
def test_vision_encoder_rejects_images_of_the_wrong_shape(shape, message):
    from glm_lightning.model.vision import VisionConfig, VisionEncoder

    cfg = VisionConfig.from_dict({"image_size": 8, "channels": 1, "patch_size": 2, "dim": 16, "heads": 2, "depth": 1})
    with pytest.raises(ValueError, match=message):
        VisionEncoder(cfg, out_dim=32).check_images(torch.zeros(shape))


def test_version_is_printed_not_an_unknown_key(capsys):
    from glm_lightning import __version__

    for argv in (["--version"], ["fit", "--version"]):
        assert run(argv) == 0
        assert capsys.readouterr().out.strip() == f"glm-lightning {__version__}"


def test_every_shipped_config_passes_the_fast_file_checks():
    from glm_lightning.help_cache import build_schema
    from glm_lightning.user_errors import check_config_files

    schema = build_schema()
    for path in sorted((ROOT / "configs").rglob("*.yaml")) + sorted(CONF.glob("*.yaml")):
        if "experiments" not in path.parts and not path.name.startswith("sweep"):
            base = [] if path.parent.name != "demo" else ["--config", str(ROOT / "configs" / path.name)]
            if not base or Path(base[1]).is_file():
                check_config_files([*base, "--config", str(path)], schema)


@pytest.mark.parametrize("text, message", [
    ("trainer: {max_stepz: 10}\n", "'trainer.max_stepz' in {file}; did you mean 'trainer.max_steps'?"),
    ("model:\n  init_args: {warmup_stepz: 3}\n", "'model.init_args.warmup_stepz' in {file}; did you mean "
                                                  "'model.init_args.warmup_steps'?"),
    ("final_validation: {enabeld: true}\n", "did you mean 'final_validation.enabled'?"),
])
def test_a_misspelt_key_in_a_file_is_found_from_the_cached_schema_without_lightning(tmp_path, text, message):
    """The schema the help cache keeps lets the command line name a misspelt key and its file before importing
    Lightning (tests/test_bad_inputs.py's CLI cases check the parser's own message for the same typos)."""
    from glm_lightning.help_cache import build_schema
    from glm_lightning.user_errors import check_config_files

    file = tmp_path / "overlay.yaml"
    file.write_text(text)
    with pytest.raises(ValueError) as err:
        check_config_files(["--config", TINY, "--config", str(file)], build_schema())
    assert message.format(file=file) in str(err.value)
    check_config_files(["--config", TINY, "--config", str(file)], None)  # without a schema: left to the parser


@pytest.mark.parametrize("argv, message", [
    (["--data.init_args.batch_size", "1.5"], "data.init_args.batch_size: expected int, got '1.5'"),
    (["--trainer.max_steps=abc"], "trainer.max_steps: expected int, got 'abc'"),
    (["--model.init_args.dev_eval", "maybe"], "model.init_args.dev_eval: expected bool, got 'maybe'"),
    (["--trainer.max_step", "3"], "unknown config key 'trainer.max_step'; did you mean 'trainer.max_steps'?"),
    (["--model.init_args.warmup_stepz=3"], "unknown config key 'model.init_args.warmup_stepz'; did you mean "
                                          "'model.init_args.warmup_steps'?"),
    (["--preflight.nope", "1"], "unknown config key 'preflight.nope'"),
])
def test_a_misspelt_key_on_the_command_line_is_found_from_the_cached_schema(argv, message):
    from glm_lightning.help_cache import build_schema
    from glm_lightning.user_errors import check_config_files

    with pytest.raises(ValueError) as err:
        check_config_files(["--config", TINY, *argv], build_schema())
    assert message in str(err.value)
    check_config_files(["--config", TINY, "--trainer.max_steps", "3", "--model.init_args.lr", "1e-3",
                        "--model.init_args.dev_eval", "false", "--data.init_args.diversity", "null",
                        "--trainer.callbacks+=ModelCheckpoint", "--trainer.logger.init_args.name", "x"],
                       build_schema())  # the real keys and values pass


def test_simple_types_are_read_from_the_annotations():
    from glm_lightning.help_cache import simple_type

    assert simple_type(int) == ("int", False) and simple_type("int | None") == ("int", True)
    assert simple_type("typing.Optional[float]") == ("float", True) and simple_type("bool") == ("bool", False)
    assert simple_type("typing.Union[int, NoneType]") == ("int", True)
    assert simple_type("list[int] | None") is None and simple_type("typing.Union[str, int]") is None


def test_a_missing_dependency_says_how_to_install_it(capsys, monkeypatch):
    """`python -m glm_lightning` run with a Python that lacks the project's packages (the system one instead of
    .venv's) used to end in a second ModuleNotFoundError from the error handler itself."""
    import glm_lightning.cli as cli

    def missing(*_args, **_kwargs):
        raise ModuleNotFoundError("No module named 'torchvision'", name="torchvision")

    monkeypatch.setattr(cli, "main", missing)
    assert run(["fit"]) == 2
    err = capsys.readouterr().err
    assert "'torchvision' is not installed" in err and "make venv" in err


def test_a_missing_module_of_our_own_keeps_its_traceback(monkeypatch):
    import glm_lightning.cli as cli

    def missing(*_args, **_kwargs):
        raise ModuleNotFoundError("No module named 'glm_lightning.nope'", name="glm_lightning.nope")

    monkeypatch.setattr(cli, "main", missing)
    with pytest.raises(ModuleNotFoundError):
        run(["fit"])


def test_an_error_raised_in_init_and_wrapped_by_the_parser_is_not_read_as_a_type_error():
    from glm_lightning.user_errors import describe

    wrapped = ("Parser key \"model\":\n  Does not validate against any of the Union subtypes\n"
               "  Subtypes: [<class 'NoneType'>, <class 'lightning.pytorch.core.module.LightningModule'>]\n"
               "  Errors:\n    - Expected a <class 'NoneType'>\n"
               "    - Problem with given class_path 'glm_lightning.modules.PretrainModule':\n"
               "        unknown preset 'huge'; choose one of ['demo']\n  Given value type: <class 'dict'>")
    assert describe(ValueError(wrapped)) == "unknown preset 'huge'; choose one of ['demo']"
