"""A model to take away: `export` writes safetensors + config.json + tokenizer.json + a model card from a real run's
checkpoint; `glm_lightning.load` reads the folder (or the checkpoint) back with the same logits; a truncated or foreign
weights file is one line; the weights-only copies the demo hands on load as start weights and refuse to resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import glm_lightning
from glm_lightning.cli import main, run
from glm_lightning.export import export, weights_only_copy
from glm_lightning.modules.base import read_checkpoint

CONF = str(Path(__file__).parent / "conf" / "pretrain_tiny.yaml")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:  # noqa: ANN001
    root = tmp_path_factory.mktemp("export_run")
    main(["fit", "--config", CONF, "--threads", "1", "--trainer.logger.init_args.save_dir", str(root),
          "--trainer.default_root_dir", str(root), "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0"])
    return next(root.glob("test/version_0/checkpoints/last.ckpt"))


def test_export_round_trip_gives_the_checkpoints_logits(ckpt, tmp_path):
    out = export(ckpt, tmp_path / "model")
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "export.json", "README.md"} <= names
    cfg, state, _ = read_checkpoint(ckpt)
    assert json.loads((out / "config.json").read_text()) == cfg.to_dict()
    record = json.loads((out / "export.json").read_text())
    assert record["stage"] == "PretrainModule" and record["global_step"] == 2
    assert record["machine"]["threads"] == 1 and record["commit"]
    card = (out / "README.md").read_text()
    assert "| optimizer steps | 2 |" in card and record["machine"]["cpu"] in card and "glm_lightning.load" in card
    text = "# Complete this Python function.\n# Add one.\ndef f(x):"
    from_ckpt, from_export = glm_lightning.load(ckpt), glm_lightning.load(out)
    assert torch.equal(from_ckpt.logits(text), from_export.logits(text))
    assert from_export.generate("def f(x):", max_new_tokens=6) == from_ckpt.generate("def f(x):", max_new_tokens=6)
    assert from_export.info["stage"] == from_ckpt.info["stage"] == "PretrainModule"
    with pytest.raises(ValueError, match="not empty"):
        export(ckpt, out)


def test_export_command_and_broken_exports_are_one_line_errors(ckpt, tmp_path, capsys):
    out = tmp_path / "cli_model"
    assert run(["export", "--ckpt", str(ckpt), "--out", str(out)]) == 0
    assert "[export] wrote" in capsys.readouterr().out
    weights = out / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # truncated
    assert run(["generate", "--ckpt", str(out), "--prompt", "a"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "not a readable safetensors file" in err[-1] and "Traceback" not in "\n".join(err)
    from safetensors.torch import save_file

    save_file({"some.other.weight": torch.zeros(3)}, str(weights))  # a foreign model's file
    assert run(["generate", "--ckpt", str(out), "--prompt", "a"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "do not fit the glm-lightning model" in last and "unexpected some.other.weight" in last


def test_weights_only_copy_is_smaller_starts_a_stage_and_refuses_to_resume(ckpt, tmp_path, capsys):
    slim = weights_only_copy(ckpt, tmp_path / "slim.ckpt")
    full = torch.load(ckpt, weights_only=False)
    assert "optimizer_states" in full and slim.stat().st_size < ckpt.stat().st_size / 2
    _, state, _ = read_checkpoint(slim)
    _, state_full, _ = read_checkpoint(ckpt)
    assert state.keys() == state_full.keys() and all(torch.equal(state[k], state_full[k]) for k in state)
    rc = run(["fit", "--config", CONF, "--trainer.logger", "false", "--trainer.max_steps", "3",
              "--ckpt_path", str(slim)])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and "holds weights only" in last and str(Path(ckpt).resolve()) in last


def test_a_checkpoint_of_another_stage_names_both_stages(ckpt, capsys):
    rl_conf = str(Path(__file__).parent / "conf" / "rl_tiny.yaml")
    rc = run(["fit", "--config", rl_conf, "--trainer.logger", "false", "--ckpt_path", str(ckpt)])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and "is a pre-training checkpoint (PretrainModule)" in last and "runs RL (RLModule)" in last


def test_an_export_folder_is_readable_by_others(ckpt, tmp_path):
    import os
    import stat

    out = export(ckpt, tmp_path / "shared")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask for f in out.iterdir())
