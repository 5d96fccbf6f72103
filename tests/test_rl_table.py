"""The tutorial-size RL report (`glm_lightning.sweep.rl_table`) on a synthetic finished sweep: hand-made per-task
outcomes and scalars for 2 variants x 2 seeds, counts checked against values worked out by hand; and the shipped
study validates (every variant instantiates) without a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glm_lightning.sweep.rl_table import count_cell, main, run_counts
from glm_lightning.sweep.runner import DONE_FILE, plan_runs
from glm_lightning.sweep.study import load_study

ROOT = Path(__file__).resolve().parent.parent
STUDY = ROOT / "configs" / "experiments" / "rl_tutorial_size.yaml"
TRAINED = ("increment", "double", "even")
UNTRAINED = ("square", "list_sum", "absolute", "nonnegative", "reverse")
N_TASKS = 10  # per family in the synthetic runs


def fam(greedy, exact):
    """A family's measurement: greedy pass per task, passing samples out of 8 per task."""
    return {"task_ids": [f"t{i}" for i in range(len(greedy))], "greedy": [float(g) for g in greedy],
            "sampled": [e / 8 for e in exact]}


def synthetic_report(gain: int, square_lost: int) -> dict:
    """Before: nothing trained passes greedily; 1 exact sample on task 0 of each trained family; square passes
    everything. After: `gain` greedy gains per trained family with 8/8 samples each, square loses `square_lost`."""
    before = {f: fam([0] * N_TASKS, [1] + [0] * (N_TASKS - 1)) for f in TRAINED}
    after = {f: fam([1] * gain + [0] * (N_TASKS - gain), [8] * gain + [0] * (N_TASKS - gain)) for f in TRAINED}
    for f in UNTRAINED:
        before[f] = fam([0] * N_TASKS, [0] * N_TASKS)
        after[f] = fam([0] * N_TASKS, [0] * N_TASKS)
    before["square"] = fam([1] * N_TASKS, [8] * N_TASKS)
    after["square"] = fam([0] * square_lost + [1] * (N_TASKS - square_lost), [0] * square_lost + [8] * (N_TASKS - square_lost))
    roles = {**{f: "rewarded" for f in TRAINED}, **{f: "monitor" for f in UNTRAINED}}
    final = {"families": {f: {"role": r} for f, r in roles.items()}}
    return {"baseline": before, "final_measurement": after, "final": final, "n_samples": 8}


def test_run_counts_by_hand():
    scalars = {"start/dev/sampled_exact": [(0, 4.0)], "dev/sampled_exact": [(0, 4.0), (20, 30.0), (70, 44.0)],
               "dev/sampled_total": [(0, 96.0), (70, 96.0)]}
    counts, roles = run_counts(synthetic_report(gain=4, square_lost=10), scalars)
    assert roles["square"] == "monitor" and roles["even"] == "rewarded"
    assert counts["greedy_trained"] == (0, 12, 30)
    assert counts["sampled_trained"] == (3, 96, 240)          # 3 x 1 sample before; 3 x 4 tasks x 8 after
    assert counts["pass_trained"] == (3, 12, 30)
    assert counts["pass_all"] == (3 + 10, 12 + 0, 80)          # square: 10 any-pass tasks before, none after
    assert counts["dev_exact"] == (4, 44, 96)
    assert count_cell(0, 16, 24) == "0/24 (0.0%) → 16/24 (66.7%)"
    with pytest.raises(ValueError, match="n_samples"):
        run_counts({**synthetic_report(1, 0), "n_samples": 0}, scalars)


def write_events(run_dir: Path, scalars: dict[str, list[tuple[int, float]]]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(run_dir))
    for tag, points in scalars.items():
        for step, value in points:
            writer.add_scalar(tag, value, step)
    writer.close()


def test_report_from_a_synthetic_sweep(tmp_path):
    study = load_study(two_seed_study(tmp_path))
    out = tmp_path / "sweeps"
    gains = {("rloo", 0): 4, ("rloo", 1): 6, ("grpo", 0): 2}  # grpo seed 1 is left unfinished
    for spec in plan_runs(study, out):
        key = (spec.variant, study.seeds.index(spec.seed))
        if key not in gains:
            continue
        spec.run_dir.mkdir(parents=True)
        report = synthetic_report(gain=gains[key], square_lost=10 if spec.variant == "rloo" else 1)
        (spec.run_dir / "regression_report.json").write_text(json.dumps(report))
        after = gains[key] / N_TASKS
        final = {"regression/after/rewarded/greedy_pass": after, "regression/after/rewarded/sampled_exact": after,
                 "regression/after/rewarded/pass@8": after, "regression/after/all/pass@8": 0.1, "dev/pass@1": 0.2}
        write_events(spec.run_dir, {"start/dev/sampled_exact": [(0, 4)], "dev/sampled_exact": [(0, 4), (9, 20)],
                                    "dev/sampled_total": [(0, 96), (9, 96)], "time/run_s": [(9, 300.0)]})
        (spec.run_dir / DONE_FILE).write_text(json.dumps({"fingerprint": spec.fingerprint, "final": final,
                                                          "steps": {}, "wall_s": 360.0}))
    text = main(["--config", str(study.path), "--out", str(out), "--report", str(tmp_path / "report.md")]).read_text()
    # the tutorial's column and our means (rloo: 12 and 18 greedy gains of 30 -> 15.0; grpo: one run, 6)
    assert "| greedy pass, trained families | 0/24 (0.0%) → 16/24 (66.7%) | 0.0/30 (0.0%) → 15.0/30 (50.0%) " \
           "| 0.0/30 (0.0%) → 6.0/30 (20.0%) |" in text
    assert "| dev exact-rollout rate | 4/96 (4.2%) → 44/96 (45.8%) | 4.0/96 (4.2%) → 20.0/96 (20.8%)" in text
    # square lost all 10 tasks in each rloo run: exact McNemar p = 2 / 2^10, Holm x5 -> flagged; grpo lost 1
    assert text.count("10/10 → 0/10; 10 lost / 0 gained; p 0.002, Holm 0.010 **REGRESSION**") == 2
    assert "10/10 → 9/10; 1 lost / 0 gained; p 1.00, Holm 1.00 |" in text
    assert "Significant regressions: square in 2/3 runs." in text
    assert "| trained (increment, double, even), pooled | 0/30 → 12/30; 12 gained / 0 lost; p 4.9e-04" in text
    assert "grpo seed" in text and "not finished" in text
    assert "6.0 min" in text and "5.0 min" in text  # DONE.json wall time and time/run_s
    # per family, rloo mean over its 2 runs: square 80 exact samples before, 0 after (both runs lost all 10 tasks)
    assert "| square | no | 80.0 → 0.0 of 80 | 80.0 → 72.0 of 80 | 10.0 → 0.0 of 10 | 10.0 → 9.0 of 10 |" in text
    assert "| increment | yes | 1.0 → 40.0 of 80 |" in text  # rloo gains 4 and 6 tasks x 8 samples: mean 40
    assert "MDE of the pass-rate change" in text and "RLOO vs GRPO" in text


def two_seed_study(tmp_path: Path) -> Path:
    """A copy of the shipped study with its first 2 seeds (the report reads the study file)."""
    import yaml

    raw = yaml.safe_load(STUDY.read_text())
    raw["seeds"] = raw["seeds"][:2]
    raw["base"] = str(STUDY.parent / raw["base"])
    path = tmp_path / "rl_tutorial_size.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_shipped_study_validates(tmp_path, monkeypatch, capsys):
    """Every variant of the shipped study instantiates (flash-25m, tied embedding trained, the callbacks' settings)
    and loads its start checkpoint from the documented path (a fresh flash-25m model saved there)."""
    import torch

    from glm_lightning.model import GLMConfig, GLMModel
    from glm_lightning.sweep.cli import run_sweep

    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "lightning_logs/pretrain/version_0/checkpoints/every/step80.ckpt"
    ckpt.parent.mkdir(parents=True)
    cfg = GLMConfig.preset("flash-25m")
    state = {f"model.{k}": v for k, v in GLMModel(cfg).state_dict().items()}
    torch.save({"glm_config": cfg.to_dict(), "state_dict": state}, ckpt)
    outcome = run_sweep(["--config", str(STUDY), "--out", str(tmp_path / "sweeps"), "--dry-run"])
    assert [v.name for v in outcome.study.variants] == ["rloo", "grpo"] and len(outcome.study.seeds) == 3
    out = capsys.readouterr().out
    assert out.count("python -m glm_lightning fit") == 6 and "--model.init_args.loss.advantage=grpo" in out
