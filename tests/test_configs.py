"""Every shipped stage config parses and instantiates (model, data, callbacks, logger) with the real CLI parser, so
a renamed argument can never silently break `python -m glm_lightning fit --config configs/...`."""

from __future__ import annotations

from pathlib import Path

import pytest

from glm_lightning.stage_cli import check_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
STAGE_CONFIGS = sorted([*CONFIGS.glob("*.yaml"), *(CONFIGS / "demo").glob("*.yaml"),
                        CONFIGS / "experiments" / "base_composition.yaml"])
OVERLAYS = {"vision_direct.yaml": "vision.yaml"}
"""Configs meant to be layered on another (`--config base --config overlay`)."""


@pytest.mark.parametrize("path", STAGE_CONFIGS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_stage_config_instantiates(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = OVERLAYS.get(str(path.relative_to(CONFIGS)))
    check_config([*(["--config", str(CONFIGS / base)] if base else []), "--config", str(path)])


def test_a_wrong_key_in_a_config_fails(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((CONFIGS / "pretrain.yaml").read_text().replace("warmup_steps:", "warmup_stepz:"))
    with pytest.raises((Exception, SystemExit)):
        check_config(["--config", str(bad)])
