"""Issue #35 section 5: `generate` and RL say at start what isolates model-written code, or which promised
protection is missing (the verifier's own refusal and warning are tested in test_verifier_kernel.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from glm_lightning.generate_cli import run
from glm_lightning.model import GLMConfig, GLMModel
from glm_lightning.modules.rl import RLModule


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:  # noqa: ANN001
    torch.manual_seed(0)
    cfg = GLMConfig.preset("tiny", max_seq_len=192)
    path = Path(tmp_path_factory.mktemp("gen")) / "tiny.ckpt"
    torch.save({"glm_config": cfg.to_dict(),
                "state_dict": {f"model.{k}": v for k, v in GLMModel(cfg).state_dict().items()}}, path)
    return str(path)


def _generate(ckpt: str) -> None:
    run(["--ckpt", ckpt, "--task", "increment", "--num_samples", "1", "--max_new_tokens", "4"], out=lambda s: None)


def test_generate_prints_the_verifier_summary_at_start(ckpt, capsys):
    _generate(ckpt)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("verifier: ")]
    assert len(lines) == 1 and ("kernel isolation active" in lines[0] or "weaker sandbox" in lines[0]), lines


def test_generate_names_a_missing_protection(ckpt, capsys, monkeypatch):
    monkeypatch.setenv("GLM_VERIFIER_NO_NAMESPACES", "1")
    monkeypatch.setenv("GLM_VERIFIER_ALLOW_WEAKER_SANDBOX", "1")
    _generate(ckpt)
    lines = [line for line in capsys.readouterr().err.splitlines() if "weaker sandbox" in line]
    assert lines and all("not active here: mount_namespace" in line and "private_root" in line for line in lines)


def test_rl_logs_the_verifier_summary_when_fitting_starts(caplog, monkeypatch):
    monkeypatch.setenv("GLM_VERIFIER_NO_NAMESPACES", "1")
    monkeypatch.setenv("GLM_VERIFIER_ALLOW_WEAKER_SANDBOX", "1")
    module = RLModule(preset="tiny", model_overrides={"max_seq_len": 192})
    try:
        with caplog.at_level(logging.INFO):
            module.on_fit_start()
    finally:
        module.close_verifier()
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("verifier: weaker sandbox, not active here: mount_namespace") for m in messages), messages
