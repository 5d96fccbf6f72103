"""The architecture ablation studies (issue 32) parse, every arm's model builds from the demo preset with its
overrides, each study asks its questions as the lab's own (a margin, no tutorial result), and a dry run plans every
run without running one."""

from pathlib import Path

import pytest

from glm_lightning.model import GLMConfig, GLMModel
from glm_lightning.sweep import load_study, run_sweep

EXPERIMENTS = Path(__file__).resolve().parent.parent / "configs" / "experiments"
STUDIES = {"ablation_mhc": "streams4", "ablation_mhc_2streams": "streams4", "ablation_mixer": "LLLS", "ablation_moe": "moe", "ablation_indexer": "top_k",
           "ablation_moe_25m": "moe", "ablation_mixer_25m": "LLLS",
           "ablation_mixer_avx512": "LLLS"}
MIN_SEEDS = {"ablation_moe_25m": 3, "ablation_mixer_25m": 3}
"""The flash-25m confirmations; every demo-scale study has at least 10 paired seeds."""


def _flat(d: dict, prefix: str = "") -> dict:
    """A nested config as {"a.b.c": value}."""
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.mark.parametrize("name", sorted(STUDIES))
def test_ablation_study_parses_builds_every_arm_and_asks_its_own_questions(name, tmp_path, capsys):
    from benchmarks.bench_ablation_steps import study_preset

    study = load_study(EXPERIMENTS / f"{name}.yaml")
    assert study.control == STUDIES[name] and len(study.seeds) >= MIN_SEEDS.get(name, 10)
    assert study.claims and all(c.own and c.margin for c in study.claims)
    assert {c.variant for c in study.claims} == {v.name for v in study.variants} - {study.control}
    for variant in study.variants:
        overrides = variant.overrides["model.init_args.model_overrides"]
        GLMModel(GLMConfig.preset(study_preset(name.removeprefix("ablation_")), **overrides))
    run_sweep(["--config", str(EXPERIMENTS / f"{name}.yaml"), "--out", str(tmp_path), "--dry-run", "--seeds", "1"])
    out = capsys.readouterr().out
    assert out.count("[todo]") == len(study.variants)
    assert not (tmp_path / name).exists()


@pytest.mark.parametrize("name", sorted(STUDIES))
def test_equal_time_arms_take_the_steps_the_measured_step_times_give(name):
    """Issue 32: each variant's `<variant>_equal_time` twin builds the same model and trains for the steps that fit in
    the control's wall-clock time, from the committed step-time measurement (benchmarks/bench_ablation_steps.py),
    evaluating once at its last step; its claim asks the same question at equal time."""
    import json

    from benchmarks.bench_ablation_steps import EQUAL_TIME_SUFFIX, RESULTS, equal_time_steps, variant_steps

    study = load_study(EXPERIMENTS / f"{name}.yaml")
    times = json.loads(RESULTS.read_text())["by_variant"]
    short = name.removeprefix("ablation_")
    control = study.variant(study.control)
    twins = [v for v in study.variants if v.name.endswith(EQUAL_TIME_SUFFIX)]
    plain = [v for v in study.variants if v.name != study.control and not v.name.endswith(EQUAL_TIME_SUFFIX)]
    assert {v.name + EQUAL_TIME_SUFFIX for v in plain} <= {t.name for t in twins}  # every arm asked at equal time too
    assert twins
    for twin in twins:
        arm = twin.name.removesuffix(EQUAL_TIME_SUFFIX)
        key = "model.init_args.model_overrides"
        if any(v.name == arm for v in plain):
            assert twin.overrides[key] == study.variant(arm).overrides[key]
        assert times[f"{short}/{arm}"]["torch_cpu"] == times[f"{short}/{study.control}"]["torch_cpu"]  # one CPU
        expected = equal_time_steps(times[f"{short}/{study.control}"]["seconds_per_step"],
                                    times[f"{short}/{arm}"]["seconds_per_step"], variant_steps(study, control))
        assert variant_steps(study, twin) == expected, (twin.name, expected)
        assert twin.overrides["trainer.val_check_interval"] == expected
    assert variant_steps(study, control) == (120 if name.endswith("_25m") else 150)


def test_the_ablation_base_is_the_demo_pretraining_with_a_finer_evaluation():
    """base_ablation_demo.yaml differs from the demo pre-training's study base only in what it evaluates and when."""
    import yaml

    demo = _flat(yaml.safe_load((EXPERIMENTS / "base_pretrain_demo.yaml").read_text()))
    ablation = _flat(yaml.safe_load((EXPERIMENTS / "base_ablation_demo.yaml").read_text()))
    changed = {k for k in demo.keys() | ablation.keys() if demo.get(k) != ablation.get(k)}
    assert changed == {"trainer.val_check_interval", "trainer.logger.init_args.name", "data.init_args.dev_per_family",
                       "data.init_args.heldout_per_family"}
    assert ablation["trainer.max_steps"] % ablation["trainer.val_check_interval"] == 0


def test_timing_some_studies_again_replaces_only_their_arms(tmp_path):
    """Re-timing one study (after changing its arms) must not move the step times the other studies' equal-time arms
    were planned from, and must replace all of that study's arms, its control included (one sitting per study)."""
    import json

    from benchmarks.bench_ablation_steps import merged

    saved = {"git": "old", "by_variant": {"moe/moe": {"seconds_per_step": 0.8}, "mixer/LLLS": {"seconds_per_step": 0.8},
                                          "mixer/all_DSA": {"seconds_per_step": 0.7}}}
    path = tmp_path / "times.json"
    path.write_text(json.dumps(saved))
    new = {"git": "new", "by_variant": {"mixer/LLLS": {"seconds_per_step": 0.9}, "mixer/all_KDA": {"seconds_per_step": 1.0}}}
    out = merged(new, path)
    assert out["git"] == "new"
    assert out["by_variant"] == {"moe/moe": {"seconds_per_step": 0.8}, "mixer/LLLS": {"seconds_per_step": 0.9},
                                 "mixer/all_KDA": {"seconds_per_step": 1.0}}  # mixer/all_DSA (old sitting) is gone
    assert merged(new, tmp_path / "none.json") == new


def test_an_arm_kept_from_an_older_sitting_keeps_that_sittings_machine(tmp_path):
    """Equal-time steps hold only on the CPU that timed them: after re-timing one study on another machine, the arms
    kept from the old sitting must still say which CPU they were timed on (the top level now names the new one)."""
    import json

    from benchmarks.bench_ablation_steps import merged

    saved = {"torch_cpu": "AVX2", "threads": 1, "by_variant": {"moe/moe": {"seconds_per_step": 0.8}}}
    path = tmp_path / "times.json"
    path.write_text(json.dumps(saved))
    new = {"torch_cpu": "AVX512", "threads": 1,
           "by_variant": {"mhc/streams4": {"seconds_per_step": 0.3, "torch_cpu": "AVX512"}}}
    out = merged(new, path)
    assert out["torch_cpu"] == "AVX512"
    assert out["by_variant"]["moe/moe"]["torch_cpu"] == "AVX2"
    assert out["by_variant"]["mhc/streams4"]["torch_cpu"] == "AVX512"


def test_the_25m_confirmation_is_the_flash_pretraining_stopped_early_with_the_studies_evaluation():
    """base_ablation_25m.yaml is configs/pretrain.yaml (the flash-25m pre-training) stopped at step 120, with the
    evaluation of the demo-scale studies (96 dev tasks, the never-trained families), and nothing else changed."""
    import yaml

    from benchmarks.bench_ablation_steps import study_preset

    shipped = _flat(yaml.safe_load((EXPERIMENTS.parent / "pretrain.yaml").read_text()))
    base = _flat(yaml.safe_load((EXPERIMENTS / "base_ablation_25m.yaml").read_text()))
    changed = {k for k in shipped.keys() | base.keys() if shipped.get(k) != base.get(k)}
    assert changed == {"trainer.max_steps", "trainer.callbacks", "trainer.default_root_dir",
                       "trainer.enable_progress_bar", "trainer.logger.init_args.name", "data.init_args.dev_per_family",
                       "data.init_args.heldout_per_family"}
    assert base["trainer.max_steps"] == 120 and base["trainer.max_steps"] % base["trainer.val_check_interval"] == 0
    assert base["data.init_args.dev_per_family"] == 12 and study_preset("moe_25m") == "flash-25m"
