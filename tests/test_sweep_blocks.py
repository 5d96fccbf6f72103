"""Studies with blocks (issue 31, part 2): seeds grouped by shared overrides (a start checkpoint each), arms paired
within a seed and so within a block, the report's per-block section (what each block loads, its level before
training, the paired differences within it), the start-checkpoint picker, and the shipped tutorial-regime screen."""

import json
import statistics
from pathlib import Path

import pytest
import yaml

from glm_lightning.sweep import StudyError, load_study
from glm_lightning.sweep.analysis import analyse
from glm_lightning.sweep.fingerprint import file_digest
from glm_lightning.sweep.report import block_section
from glm_lightning.sweep.runner import RunResult, plan_runs
from glm_lightning.sweep.starts import candidates, choose_starts, pick
from glm_lightning.sweep.study import REPO_ROOT

TINY = Path(__file__).parent / "conf" / "sweep_tiny.yaml"
SCREEN = REPO_ROOT / "configs" / "experiments" / "rl_screen_tutorial.yaml"


def _blocked_study(tmp_path: Path, blocks: dict | None = None) -> Path:
    raw = yaml.safe_load(TINY.read_text())
    raw["base"] = str((TINY.parent / raw["base"]).resolve())
    del raw["seeds"]
    for name in ("a", "b"):
        (tmp_path / f"{name}.ckpt").write_bytes(name.encode() * 10)
    raw["blocks"] = blocks or {
        "a": {"seeds": [0, 1, 2], "overrides": {"model.init_args.init_weights": str(tmp_path / "a.ckpt")}},
        "b": {"seeds": [10, 11, 12], "overrides": {"model.init_args.init_weights": str(tmp_path / "b.ckpt")}}}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_blocks_give_their_seeds_their_overrides(tmp_path):
    study = load_study(_blocked_study(tmp_path))
    assert study.seeds == [0, 1, 2, 10, 11, 12] and study.block_of(11).name == "b" and study.block_of(5) is None
    args = study.run_args(study.variants[1], 11)
    assert f"--model.init_args.init_weights={tmp_path / 'b.ckpt'}" in args
    assert study.fingerprint_parts(study.variants[0], 0)["checkpoints"] == {
        str(tmp_path / "a.ckpt"): file_digest(tmp_path / "a.ckpt")[:16]}
    cut = study.with_seed_count(2)  # --seeds counts seeds per block
    assert cut.seeds == [0, 1, 10, 11] and cut.blocks["b"].seeds == (10, 11)
    with pytest.raises(StudyError, match="per block"):
        study.with_seed_count(4)
    with pytest.raises(StudyError, match="blocks"):
        study.with_settings({"model.init_args.init_weights": "x.ckpt"})


@pytest.mark.parametrize("change, message", [
    ({"seeds": 4}, "exactly one of `seeds`"),
    ({"blocks": {"a": {"seeds": [0, 1]}, "b": {"seeds": [1, 2]}}}, "belong to another block"),
    ({"blocks": {"a": {"seeds": [0], "overrides": {}, "colour": 1}}}, "blocks.a must be"),
])
def test_bad_blocks_fail_at_load(tmp_path, change, message):
    path = _blocked_study(tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw.update(change)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(StudyError, match=message):
        load_study(path)


def test_pairs_stay_within_blocks_and_the_report_shows_each_block(tmp_path):
    study = load_study(_blocked_study(tmp_path))
    # block a: interleaved +0.02 over blocked; block b (a better start): +0.06; before training 0.25 and 0.30
    results = []
    for spec in plan_runs(study, tmp_path / "out"):
        block = study.block_of(spec.seed).name
        base = {"a": 0.40, "b": 0.60}[block] + 0.001 * spec.seed
        gain = {"a": 0.02, "b": 0.06}[block] if spec.variant == "interleaved" else 0.0
        final = {"val/completion_acc": base + gain, "val/loss": 1.0,
                 "start/screen/greedy_pass": {"a": 0.25, "b": 0.30}[block]}
        results.append(RunResult(spec, "skipped", final))
    analysis = analyse(study, results)[0]
    comp = analysis.comparisons[0]
    assert comp.n == 6 and comp.diffs == pytest.approx([0.02] * 3 + [0.06] * 3)  # never a cross-block pair
    text = "\n".join(block_section(study, analysis, results))
    row_a = next(line for line in text.splitlines() if line.startswith("| a |"))
    row_b = next(line for line in text.splitlines() if line.startswith("| b |"))
    assert f"{file_digest(tmp_path / 'a.ckpt')[:16]}" in row_a and "screen/greedy_pass 25.0" in row_a
    assert "+2.0 (n=3)" in row_a and "+6.0 (n=3)" in row_b and "screen/greedy_pass 30.0" in row_b
    assert statistics.mean(comp.diffs) == pytest.approx(0.04)


def test_starts_pick_the_checkpoint_closest_to_the_target(tmp_path):
    passes = {}
    runs = {}
    for seed, levels in enumerate(([0.05, 0.18, 0.31, 0.52], [0.10, 0.24, 0.26, 0.60])):
        run = tmp_path / f"seed{seed}"
        (run / "checkpoints" / "every").mkdir(parents=True)
        for step, level in zip((20, 40, 60, 80), levels):
            ckpt = run / "checkpoints" / "every" / f"step{step:03d}.ckpt"
            ckpt.write_bytes(f"{seed}-{step}".encode())
            passes[ckpt] = level
        (run / "checkpoints" / "last.ckpt").write_bytes(b"not a candidate")
        runs[f"pt{seed}"] = run
    record = choose_starts(runs, tmp_path / "starts", 0.25, lambda p: passes[p], log=lambda _m: None)
    assert record["pt0"]["source"].endswith("step060.ckpt") and record["pt0"]["greedy_pass"] == 0.31
    assert record["pt1"]["source"].endswith("step040.ckpt")  # 0.24 and 0.26 tie at 0.01: the earlier one
    assert (tmp_path / "starts" / "pt1.ckpt").read_bytes() == b"1-40"
    saved = json.loads((tmp_path / "starts" / "starts.json").read_text())
    assert saved["pt1"]["sha256"] == file_digest(tmp_path / "starts" / "pt1.ckpt")
    assert len(saved["pt0"]["candidates"]) == 4
    assert pick({Path("x"): 0.5, Path("y"): 0.0}, 0.25) == Path("x")


def test_start_passes_are_cached_by_digest_so_a_second_pick_evaluates_only_new_files(tmp_path):
    from glm_lightning.sweep.starts import PassCache

    every = tmp_path / "run" / "checkpoints" / "every"
    every.mkdir(parents=True)
    for step in (4, 8):
        (every / f"step{step}.ckpt").write_bytes(f"weights {step}".encode())
    seen: list[str] = []

    def evaluate(p: Path) -> float:
        seen.append(p.name)
        return {4: 0.1, 8: 0.2, 12: 0.3}[int(p.stem[4:])]

    cache_file = tmp_path / "cache.json"
    choose_starts({"pt0": tmp_path / "run"}, tmp_path / "out", 0.25, evaluate, log=lambda _m: None,
                  cache=PassCache(cache_file, "dev|32"))
    (every / "step12.ckpt").write_bytes(b"weights 12")  # pre-training wrote one more
    (every / "step4.ckpt").write_bytes(b"weights 4, rewritten")  # and a file changed: evaluated again
    record = choose_starts({"pt0": tmp_path / "run"}, tmp_path / "out", 0.25, evaluate, log=lambda _m: None,
                           cache=PassCache(cache_file, "dev|32"))
    assert seen == ["step4.ckpt", "step8.ckpt", "step4.ckpt", "step12.ckpt"]
    assert record["pt0"]["source"].endswith("step8.ckpt")  # 0.2 and 0.3 tie at 0.05: the earlier step
    # other evaluation settings never read these passes
    assert PassCache(cache_file, "dev|64").get(every / "step8.ckpt") is None
    cache_file.write_text("not json")
    assert PassCache(cache_file, "dev|32").data == {}


def test_start_candidates_come_in_step_order_so_ties_go_to_the_earlier_step(tmp_path):
    # the pre-training callback writes unpadded names (step4, step12, step100): string order would put step100 first
    every = tmp_path / "run" / "checkpoints" / "every"
    every.mkdir(parents=True)
    for step in (100, 12, 4, 8):
        (every / f"step{step}.ckpt").write_bytes(str(step).encode())
    found = candidates(tmp_path / "run")
    assert [p.name for p in found] == ["step4.ckpt", "step8.ckpt", "step12.ckpt", "step100.ckpt"]
    passes = {p: {4: 0.0, 8: 0.0625, 12: 0.125, 100: 0.375}[int(p.stem[4:])] for p in found}
    assert pick(passes, 0.25).name == "step12.ckpt"  # 0.125 and 0.375 tie at exactly 0.125: the earlier step
    assert [p.name for p in candidates(tmp_path / "run", (8, 12))] == ["step8.ckpt", "step12.ckpt"]
    with pytest.raises(StudyError, match="has a step in 13:99"):
        candidates(tmp_path / "run", (13, 99))


def test_the_shipped_screen_study_is_the_tutorials_regime():
    study = load_study(SCREEN)
    assert list(study.blocks) == ["pt0", "pt1", "pt2"] and all(len(b.seeds) == 6 for b in study.blocks.values())
    assert len(study.variants) == 8 and study.control == "baseline" and len(study.claims) == 7
    assert study.regime.startswith("tutorial's screen")
    base = yaml.safe_load(study.base.read_text())
    rl = base["model"]["init_args"]
    assert rl["preset"] == "flash-25m" and rl["lr"] == 5.0e-5 and rl["untie_head"] is False
    assert rl["sampling"] == {"group_size": 8, "temperature": 0.35, "max_new_tokens": 32}
    assert base["data"]["init_args"]["train_families"] == ["increment", "double", "square", "even", "reverse"]
    evaluation = next(c for c in base["trainer"]["callbacks"] if c["class_path"].endswith("PassAtKCallback"))
    assert evaluation["init_args"]["per_family"] >= 32 and evaluation["init_args"]["evaluate_at_start"] is True
    # 128 training completions in every arm: prompts (one per step) x group size
    for v in study.variants:
        steps = v.overrides.get("trainer.max_steps", base["trainer"]["max_steps"])
        g = v.overrides.get("model.init_args.sampling.group_size", rl["sampling"]["group_size"])
        assert steps * g * base["data"]["init_args"]["batch_size"] == 128, v.name


def test_the_shipped_screen_study_validates(tmp_path, monkeypatch, capsys):
    """Every arm and block parses and instantiates (flash-25m, the callbacks) from start checkpoints at the
    documented paths (fresh flash-25m weights saved there)."""
    import torch

    from glm_lightning.model import GLMConfig, GLMModel
    from glm_lightning.sweep.cli import run_sweep

    monkeypatch.chdir(tmp_path)
    cfg = GLMConfig.preset("flash-25m")
    state = {f"model.{k}": v for k, v in GLMModel(cfg).state_dict().items()}
    (tmp_path / "runs" / "starts").mkdir(parents=True)
    torch.save({"glm_config": cfg.to_dict(), "state_dict": state}, tmp_path / "runs" / "starts" / "pt0.ckpt")
    for k in (1, 2):
        (tmp_path / "runs" / "starts" / f"pt{k}.ckpt").hardlink_to(tmp_path / "runs" / "starts" / "pt0.ckpt")
    run_sweep(["--config", str(SCREEN), "--out", str(tmp_path / "sweeps"), "--dry-run", "--seeds", "1"])
    out = capsys.readouterr().out
    assert out.count("python -m glm_lightning fit") == 24 and "init_weights=runs/starts/pt2.ckpt" in out


def test_recorded_and_reproduced_seed_counts_are_per_block(tmp_path):
    import argparse

    from glm_lightning.sweep.cli import SWEEP_FILE, record_arguments, reproduce_command

    study = load_study(_blocked_study(tmp_path)).with_seed_count(2)
    args = argparse.Namespace(config="study.yaml", settings=[], threads_per_run=1, out="runs", backend="local")
    record_arguments(tmp_path / "out", args, study)
    assert json.loads((tmp_path / "out" / SWEEP_FILE).read_text())["seeds"] == 2
    assert "--seeds 2 " in reproduce_command(args, study, 2)


def test_the_objective_study_runs_at_a_completion_budget_and_is_planned(tmp_path, monkeypatch, capsys):
    """rl_screen_tutorial_t1 (issue 47): every arm trains at T 1 and ends after 128 completions (a budget, not steps),
    its seed cut is stated beside the power plan it falls short of, and it parses from starts at the documented
    paths."""
    import torch

    from glm_lightning.model import GLMConfig, GLMModel
    from glm_lightning.sweep.cli import run_sweep
    from glm_lightning.sweep.plan import plan_claims

    path = REPO_ROOT / "configs" / "experiments" / "rl_screen_tutorial_t1.yaml"
    study = load_study(path)
    base = yaml.safe_load(study.base.read_text())
    assert base["trainer"]["max_steps"] == -1 and base["model"]["init_args"]["budget"] == {"completions": 128}
    assert study.overrides == {"model.init_args.loss.train_temperature": 1.0}
    plans, note = plan_claims(study)
    # as run: 18 seeds per arm (the plan asked 33, cut for compute before the results); T 0.2 reaches its plan, T 0.8
    # does not, and the study file says so and ships the override its runs needed
    assert not note and {p.variant: p.reachable for p in plans} == {"T0.2": True, "T0.8": False}
    assert "--allow-underpowered" in path.read_text() and "11 RL seeds = 99 runs" in study.raw["budget"]
    monkeypatch.chdir(tmp_path)
    cfg = GLMConfig.preset("flash-25m")
    state = {f"model.{k}": v for k, v in GLMModel(cfg).state_dict().items()}
    (tmp_path / "runs" / "starts").mkdir(parents=True)
    torch.save({"glm_config": cfg.to_dict(), "state_dict": state}, tmp_path / "runs" / "starts" / "pt0.ckpt")
    for k in (1, 2):
        (tmp_path / "runs" / "starts" / f"pt{k}.ckpt").hardlink_to(tmp_path / "runs" / "starts" / "pt0.ckpt")
    run_sweep(["--config", str(path), "--out", str(tmp_path / "sweeps"), "--dry-run", "--seeds", "1"])
    out = capsys.readouterr().out
    assert out.count("python -m glm_lightning fit") == 9 and "train_temperature=1.0" in out
