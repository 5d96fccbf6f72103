"""`make demo`'s chain (pre-training -> vision -> RL -> summary), shrunk with --smoke: every stage runs, each stage
starts from the previous stage's weights, and the summary carries every stage's numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from glm_lightning.demo import main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _lm_state(path: str) -> dict[str, torch.Tensor]:
    state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("model.")}


def test_demo_smoke_chains_all_stages(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    results = main(["--smoke"])
    assert [r.name for r in results] == ["pre-training", "vision", "RL"]
    assert all(r.checkpoint and (tmp_path / r.checkpoint).is_file() for r in results)
    pre, vis, rl = results
    # vision trained only its encoder and the image-token adapters: every LM tensor equals stage 1's
    a, b = _lm_state(pre.checkpoint), _lm_state(vis.checkpoint)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    vis_state = torch.load(vis.checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    assert any(k.startswith("vision.") for k in vis_state) and any(k.startswith("image_adapters.") for k in vis_state)
    assert "test/acc" in vis.metrics and "val/dev_pass" in vis.extra["text_dev_pass_after"]
    assert "val/pass@1/rewarded" in rl.extra["before"] and "val/pass@1/rewarded" in rl.metrics
    assert rl.extra["regression"]["families"], "regression verdicts for the monitored families"
    for name in ("pretrain", "vision", "rl"):
        assert (tmp_path / "lightning_logs" / "smoke" / "demo" / f"{name}.ckpt").is_file()
    # a smoke run never replaces a real run's results, and writes nothing outside lightning_logs/smoke
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lightning_logs"]
    assert sorted(p.name for p in (tmp_path / "lightning_logs").iterdir()) == ["smoke"]
    out = capsys.readouterr().out
    assert "demo summary" in out and "test/acc" in out and "pass@8 rewarded" in out and "tensorboard --logdir" in out


def test_dry_run_checks_every_stage_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["--dry-run"]) == []
    out = capsys.readouterr().out
    assert [s for s in ("pretrain", "vision", "rl") if f"[demo] {s}: config OK" in out] == ["pretrain", "vision", "rl"]
    assert "--model.init_args.init_weights lightning_logs/demo/pretrain.ckpt" in out
    assert list(tmp_path.iterdir()) == []


def test_dry_run_fails_on_a_broken_stage_config(tmp_path, monkeypatch):
    import glm_lightning.demo as demo

    bad = tmp_path / "rl_overlay.yaml"
    bad.write_text("model:\n  init_args:\n    lrr: 0.1\n")
    monkeypatch.setitem(demo.STAGE_CONFIGS, "rl", ("rl.yaml", str(bad)))
    with pytest.raises(Exception, match="lrr"):
        main(["--dry-run"])


def test_demo_rejects_a_broken_chain():
    with pytest.raises(SystemExit, match="prefix"):
        main(["--stages", "vision,rl"])


def test_rl_studies_start_from_the_demo_checkpoint(tmp_path, monkeypatch, capsys):
    """The shipped RL studies validate (every variant instantiates, init_weights loads) once the demo has written
    lightning_logs/demo/pretrain.ckpt."""
    from pathlib import Path

    from glm_lightning.sweep.cli import run_sweep

    import shutil

    monkeypatch.chdir(tmp_path)
    main(["--smoke", "--stages", "pretrain"])
    assert not (tmp_path / "lightning_logs" / "demo").exists()
    (tmp_path / "lightning_logs" / "demo").mkdir()
    shutil.copy(tmp_path / "lightning_logs" / "smoke" / "demo" / "pretrain.ckpt", tmp_path / "lightning_logs" / "demo")
    experiments = Path(__file__).resolve().parent.parent / "configs" / "experiments"
    # The tutorial-size and tutorial-regime studies start from flash-25m checkpoints, not the demo's.
    studies = sorted(p for p in experiments.glob("rl_*.yaml")
                     if not p.stem.startswith(("rl_tutorial_size", "rl_screen_")))
    assert [p.stem for p in studies] == ["rl_group_size", "rl_invalid_penalty", "rl_reward", "rl_temperature"]
    for study in studies:
        run_sweep(["--config", str(study), "--out", str(tmp_path / "sweeps"), "--dry-run"])
    out = capsys.readouterr().out
    assert out.count("python -m glm_lightning fit") >= 3 * (2 + 3 + 3 + 3)


def test_demo_pretrain_evaluates_its_last_step_whatever_the_stage_config_says():
    """The demo overlay pins its own length: a change to configs/pretrain.yaml (sized for the research run) once made
    the demo train 200 steps while evaluating at step 150, so its summary described an older model than its checkpoint."""
    base = yaml.safe_load((CONFIGS / "pretrain.yaml").read_text())
    overlay = yaml.safe_load((CONFIGS / "demo" / "pretrain.yaml").read_text())
    trainer = {**base["trainer"], **overlay["trainer"]}
    assert "max_steps" in overlay["trainer"], "the demo must pin its own number of steps"
    assert trainer["max_steps"] % trainer["val_check_interval"] == 0, "the demo's last step must be evaluated"
    assert "dev_per_family" in overlay["data"]["init_args"], "the demo must pin its own evaluation set"
