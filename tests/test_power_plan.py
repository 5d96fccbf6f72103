"""The power plan (issue 47): before a study runs, `sweep` prints the seeds each equivalence claim's margin needs from
an earlier study's SD of paired differences, refuses a study whose claims cannot reach equivalence, and the override
is named in the report."""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

import glm_lightning.sweep.plan as plan
from glm_lightning.power import tost_seeds
from glm_lightning.sweep.cli import run_sweep
from glm_lightning.sweep.study import StudyError, load_study

TINY = Path(__file__).parent / "conf" / "sweep_tiny.yaml"


def _study(tmp_path: Path, seeds: int, margin: float) -> Path:
    raw = yaml.safe_load(TINY.read_text())
    raw.update(base=str((TINY.parent / raw["base"]).resolve()), name="plan_tiny", seeds=seeds,
               claims=[{"claim": "interleaved is as good as blocked", "variant": "interleaved", "margin": margin}],
               power_plan={"sd_from": "pilot_tiny", "reason": "a 12-seed pilot"})
    path = tmp_path / "plan_tiny.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.fixture()
def pilot(tmp_path, monkeypatch) -> np.ndarray:
    """A committed pilot: 12 seeds, paired differences with SD about 10 points."""
    rng = np.random.default_rng(0)
    base = rng.uniform(0.3, 0.6, 12)
    diffs = rng.normal(0.0, 0.10, 12)
    runs = [{"variant": v, "seed": s, "final": {"val/completion_acc": float(x)}}
            for s in range(12) for v, x in (("blocked", base[s]), ("interleaved", base[s] + diffs[s]))]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "pilot_tiny.json").write_text(json.dumps({"runs": runs}))
    monkeypatch.setattr(plan, "DATA_DIR", tmp_path / "data")
    return diffs * 100


def test_the_plan_computes_the_seeds_from_the_pilots_sd(tmp_path, pilot):
    study = load_study(_study(tmp_path, seeds=10, margin=5.0))
    (p,), note = plan.plan_claims(study)
    assert not note
    assert p.sd == pytest.approx(float(np.std(pilot, ddof=1)))
    assert p.needed == tost_seeds(5.0, p.sd, 0.05) and p.needed > 10 and not p.reachable


def test_sweep_refuses_an_unreachable_equivalence_claim(tmp_path, pilot):
    path = _study(tmp_path, seeds=10, margin=5.0)
    said = []
    with pytest.raises(StudyError, match=r"cannot reach with 10 seeds: interleaved \(needs \d+\).*--allow-underpowered"):
        run_sweep(["--config", str(path), "--out", str(tmp_path / "out")], log=said.append)
    assert any(line.startswith("[plan] interleaved vs control") for line in said)
    assert not (tmp_path / "out" / "plan_tiny").exists()  # refused before anything ran


def test_the_override_is_named_and_a_reachable_plan_passes(tmp_path, pilot):
    study = load_study(_study(tmp_path, seeds=10, margin=5.0))
    note = plan.power_plan(study, allow_underpowered=True, log=lambda _m: None)
    assert "--allow-underpowered" in note and "CANNOT REACH" in note
    wide = load_study(_study(tmp_path, seeds=10, margin=20.0))
    assert "CANNOT" not in plan.power_plan(wide, allow_underpowered=False, log=lambda _m: None)


def test_without_a_pilot_the_plan_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(plan, "DATA_DIR", tmp_path)
    note = plan.power_plan(load_study(_study(tmp_path, seeds=10, margin=5.0)), False, log=lambda _m: None)
    assert note.startswith("no power plan") and "pilot" in note


def test_the_plan_bounds_what_more_evaluation_tasks_buy(tmp_path, pilot):
    """With `eval_tasks` stated, each claim's line gives the seeds needed with 2x and 4x the tasks as a range: at most
    today's count (more tasks never add variance), at least the count if all binomial task-sampling variance went."""
    path = _study(tmp_path, seeds=10, margin=5.0)
    raw = yaml.safe_load(path.read_text())
    raw["power_plan"]["eval_tasks"] = 40
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    (p,), _ = plan.plan_claims(load_study(path))
    assert "2x tasks (80)" in p.line() and "4x tasks (160)" in p.line()
    low4 = int(p.tasks.split("4x tasks (160): ")[1].split("-")[0].split(" ")[0])
    low2 = int(p.tasks.split("2x tasks (80): ")[1].split("-")[0].split(" ")[0])
    assert low4 <= low2 <= p.needed
    # a pass rate near 0.45 on 40 tasks has task-sampling SD up to ~11 points on a difference: here more than the
    # pilot's ~10, so the lower bound is the SD shrunk by the factor itself
    assert low4 == tost_seeds(5.0, p.sd / 2, 0.05)
    # a bigger task count leaves less to gain: the bound tightens towards today's need
    raw["power_plan"]["eval_tasks"] = 100000
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    (q,), _ = plan.plan_claims(load_study(path))
    assert q.tasks.split("4x tasks (400000): ")[1].split(" ")[0] == str(q.needed)
