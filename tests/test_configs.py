"""Every shipped stage config parses and instantiates (model, data, callbacks, logger) with the real CLI parser, so
a renamed argument can never silently break `python -m glm_lightning fit --config configs/...`."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from glm_lightning.cli import main
from glm_lightning.stage_cli import check_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
STAGE_CONFIGS = sorted([*CONFIGS.glob("*.yaml"), *(CONFIGS / "demo").glob("*.yaml"),
                        CONFIGS / "experiments" / "base_composition.yaml"])
OVERLAYS = {"vision_direct.yaml": ["vision_scratch.yaml"], "demo/pretrain.yaml": ["pretrain.yaml"],
            "demo/vision.yaml": ["vision.yaml"], "demo/vision_last_block.yaml": ["vision.yaml", "demo/vision.yaml"],
            "demo/rl.yaml": ["rl.yaml"]}
"""Configs meant to be layered on others (`--config base --config overlay`)."""


@pytest.mark.parametrize("path", STAGE_CONFIGS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_stage_config_instantiates(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bases = OVERLAYS.get(str(path.relative_to(CONFIGS)), [])
    check_config([*(arg for base in bases for arg in ("--config", str(CONFIGS / base))), "--config", str(path)])


def test_a_wrong_key_in_a_config_fails(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((CONFIGS / "pretrain.yaml").read_text().replace("warmup_steps:", "warmup_stepz:"))
    with pytest.raises((Exception, SystemExit)):
        check_config(["--config", str(bad)])


SHARED_STAGE_ARGS = ("preset", "model_overrides", "init_weights", "lr", "min_lr_ratio", "weight_decay", "betas",
                     "warmup_steps")


@pytest.mark.parametrize("config", ["pretrain.yaml", "vision.yaml", "rl.yaml"])
def test_print_config_lists_the_shared_stage_arguments(config, capsys):
    """Stages forward the shared arguments with **kwargs; LightningCLI must still list every one of them."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIGS / config), "--print_config"])
    assert exit_info.value.code in (0, None)
    init_args = yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]
    missing = [name for name in SHARED_STAGE_ARGS if name not in init_args]
    assert not missing, missing


def test_help_shows_the_settings_dataclasses_attribute_docstrings(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--model.help", "glm_lightning.modules.rl.RLModule"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--model.sampling.temperature" in text and "the trained policy's is `loss.train_temperature`" in text
    assert "--model.loss.train_temperature" in text and "--model.budget.completions" in text


def test_config_time_checks_name_the_keys_to_change(tmp_path, monkeypatch):
    """A freeze pattern for a block the preset does not have, or a monitor the run never logs, fails when the config
    is checked (sweep validation, demo --dry-run), not after training."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"'model.blocks.11.\*' matches no parameter; closest names: model.blocks"):
        check_config(["--config", str(CONFIGS / "rl.yaml"), "--model.init_args.preset", "tiny"])
    with pytest.raises(ValueError, match="model.init_args.dev_eval is false"):
        check_config(["--config", str(CONFIGS / "pretrain.yaml"), "--model.init_args.dev_eval", "false"])


def test_continuing_stages_print_that_init_weights_is_required(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(CONFIGS / "rl.yaml"), "--print_config"])
    init_args = yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]
    assert init_args["init_weights"].startswith("required")


def test_disabling_the_progress_bar_drops_the_configs_progress_bar(tmp_path, monkeypatch):
    """pretrain.yaml lists a RichProgressBar; `--trainer.enable_progress_bar false` used to stop Lightning with a
    conflict instead of running without the bar."""
    from lightning.pytorch.callbacks import ProgressBar

    from glm_lightning.stage_cli import build_cli

    monkeypatch.chdir(tmp_path)
    base = ["--config", str(CONFIGS / "pretrain.yaml"), "--model.init_args.preset", "tiny"]
    with_bar = build_cli(base, run=False)
    assert any(isinstance(cb, ProgressBar) for cb in with_bar.trainer.callbacks)
    cli = build_cli([*base, "--trainer.enable_progress_bar", "false"], run=False)
    assert not any(isinstance(cb, ProgressBar) for cb in cli.trainer.callbacks)
    assert cli.trainer.progress_bar_callback is None
