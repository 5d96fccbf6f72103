"""Checkpoints load with `weights_only=True` and the project's allow-list (never `weights_only=False`), and a stage
that needs start weights names a checkpoint of its own model config that a documented command writes."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import yaml

from glm_lightning.model import GLMConfig
from glm_lightning.modules import PretrainModule
from glm_lightning.modules.base import (CHECKPOINT_GLOBALS, SHIPPED_START_CHECKPOINTS, read_checkpoint,
                                        start_checkpoint_hint)

ROOT = Path(__file__).resolve().parent.parent


def test_a_module_built_in_python_saves_a_checkpoint_that_loads_weights_only(tmp_path):
    """A stage built in Python keeps settings dataclasses in its hyperparameters (VerifierSettings here); they are on
    the allow-list, so the file loads with weights_only=True, which refuses them without it."""
    module = PretrainModule(preset="tiny")
    path = tmp_path / "python_built.ckpt"
    torch.save({"glm_config": module.glm_config.to_dict(), "hyper_parameters": dict(module.hparams),
                "state_dict": {f"model.{k}": v for k, v in module.model.state_dict().items()}}, path)
    assert any(type(v) in CHECKPOINT_GLOBALS for v in module.hparams.values())
    registered = torch.serialization.get_safe_globals()  # a stage CLI run earlier in this process added the list
    torch.serialization.clear_safe_globals()
    try:
        with pytest.raises(pickle.UnpicklingError):
            torch.load(path, weights_only=True)  # plain torch: the dataclass is not a tensor
    finally:
        torch.serialization.add_safe_globals(registered)
    cfg, state, ckpt = read_checkpoint(path)
    assert cfg == module.glm_config and set(state) == set(module.model.state_dict())
    assert ckpt["hyper_parameters"]["verifier"] == module.hparams["verifier"]


def test_a_pickled_object_outside_the_allow_list_is_refused(tmp_path):
    path = tmp_path / "foreign.ckpt"
    torch.save({"glm_config": GLMConfig.preset("tiny").to_dict(), "payload": Path("x")}, path)
    with pytest.raises(ValueError, match="is not a checkpoint"):
        read_checkpoint(path)


@pytest.mark.parametrize("stage", ["vision.yaml", "rl.yaml"])
def test_the_start_weights_hint_names_what_pretrain_yaml_writes_for_that_model(stage):
    """configs/vision.yaml and configs/rl.yaml continue configs/pretrain.yaml's model: the hint must name the path
    that config writes (its logger's first version), not the demo's smaller model."""
    pre = yaml.safe_load((ROOT / "configs" / "pretrain.yaml").read_text())
    cont = yaml.safe_load((ROOT / "configs" / stage).read_text())
    preset = cont["model"]["init_args"]["preset"]
    assert preset == pre["model"]["init_args"]["preset"]
    logger = pre["trainer"]["logger"]["init_args"]
    written = f"{logger['save_dir']}/{logger['name']}/version_0/checkpoints/last.ckpt"
    hint = start_checkpoint_hint(preset, cont["model"]["init_args"].get("model_overrides"))
    assert written in hint and "configs/pretrain.yaml" in hint


def test_the_demo_hint_names_the_demo_checkpoint():
    demo = yaml.safe_load((ROOT / "configs" / "demo" / "pretrain.yaml").read_text())
    assert "lightning_logs/demo/pretrain.ckpt" in start_checkpoint_hint(demo["model"]["init_args"]["preset"], None)
    assert set(SHIPPED_START_CHECKPOINTS) <= set(["flash-25m", "demo"])
    assert "preset 'tiny'" in start_checkpoint_hint("tiny", None)
    assert "model_overrides {'d_model': 64}" in start_checkpoint_hint("flash-25m", {"d_model": 64})
