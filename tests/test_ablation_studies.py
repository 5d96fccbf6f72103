"""The architecture ablation studies (issue 32) parse, every arm's model builds from the demo preset with its
overrides, each study asks its questions as the lab's own (a margin, no tutorial result), and a dry run plans every
run without running one."""

from pathlib import Path

import pytest

from glm_lightning.model import GLMConfig, GLMModel
from glm_lightning.sweep import load_study, run_sweep

EXPERIMENTS = Path(__file__).resolve().parent.parent / "configs" / "experiments"
STUDIES = {"ablation_mhc": "streams4", "ablation_mixer": "LLLS", "ablation_moe": "moe", "ablation_indexer": "top_k"}


@pytest.mark.parametrize("name", sorted(STUDIES))
def test_ablation_study_parses_builds_every_arm_and_asks_its_own_questions(name, tmp_path, capsys):
    study = load_study(EXPERIMENTS / f"{name}.yaml")
    assert study.control == STUDIES[name] and len(study.seeds) >= 10
    assert study.claims and all(c.own and c.margin for c in study.claims)
    assert {c.variant for c in study.claims} == {v.name for v in study.variants} - {study.control}
    for variant in study.variants:
        overrides = variant.overrides["model.init_args.model_overrides"]
        GLMModel(GLMConfig.preset("demo", **overrides))
    run_sweep(["--config", str(EXPERIMENTS / f"{name}.yaml"), "--out", str(tmp_path), "--dry-run", "--seeds", "1"])
    out = capsys.readouterr().out
    assert out.count("[todo]") == len(study.variants)
    assert not (tmp_path / name).exists()
