"""The profiling benchmark: its study model is the one the studies train, and its op count is deterministic."""

from pathlib import Path

import yaml

from benchmarks.profile_step import STUDY_OVERRIDES, build, profile_step
from benchmarks.bench_vs_commit import WORKER

ROOT = Path(__file__).resolve().parent.parent


def test_study_model_matches_the_base_composition_config():
    cfg = yaml.safe_load((ROOT / "configs/experiments/base_composition.yaml").read_text())
    args = cfg["model"]["init_args"]
    assert args["preset"] == "tiny"
    assert args["model_overrides"] == STUDY_OVERRIDES
    for key, value in STUDY_OVERRIDES.items():  # the alternated A/B worker builds the same model
        assert f"{key}={value}" in WORKER


def test_op_count_is_deterministic_and_split_by_phase():
    _, a = profile_step("study", warmup=1)
    _, b = profile_step("study", warmup=1)
    assert a == b
    assert a["total"] == a["forward"] + a["backward"] + a["optimizer"] + a["other"]
    assert a["forward"] > 0 and a["backward"] > 0 and a["optimizer"] > 0 and a["other"] == 0
    model, batch, seq = build("study")
    assert (batch, seq) == (8, 128) and model.cfg.d_model == 48
