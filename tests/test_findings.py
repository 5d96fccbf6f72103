"""The findings table from synthetic study results (no training): the verdict rule on every branch, claims that
fail to parse, "not run" and stale results, results read from the runs directory and from the committed copy, and
the shipped study files' claims."""

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from glm_lightning.sweep import StudyError, load_study
from glm_lightning.sweep.analysis import analyse
from glm_lightning.stats import format_p, holm, tost_sign_flip
from glm_lightning.sweep.claims import Claim, judge
from glm_lightning.sweep.findings import (EXPERIMENTS, STUDIES, main, results_payload, write_results)
from glm_lightning.sweep.runner import DONE_FILE, RunResult, plan_runs

TINY = Path(__file__).parent / "conf" / "sweep_tiny.yaml"  # blocked (control) vs interleaved
INF, NAN = math.inf, math.nan

EFFECT = Claim("interleaved beats blocked", "interleaved", effect=9.7, p=0.002, n="10", ci=(7.6, 11.7))
NULL = Claim("no difference", "interleaved", effect=-0.6, p=0.21, n="10", margin=2.0)


def test_a_size_comparison_names_how_the_settings_differ():
    from dataclasses import replace

    assert "differ" not in judge(EFFECT, 16.8, 15.3, 18.2, 0.002, 1.9).why  # settings that match
    why = judge(replace(EFFECT, differs="top-2 routing vs top-1"), 16.8, 15.3, 18.2, 0.002, 1.9).why
    assert "larger than the tutorial's (our CI excludes +9.7), in settings that differ: top-2 routing vs top-1" in why


@pytest.mark.parametrize("claim, ours, word, why", [
    (EFFECT, (9.0, 7.0, 11.0, 0.002, 2.0), "reproduced", "same direction"),
    (EFFECT, (4.5, 2.9, 6.1, 0.002, 2.0), "reproduced", "smaller than the tutorial's"),
    (EFFECT, (-3.0, -5.0, -1.0, 0.01, 2.0), "refuted", "opposite direction"),
    (EFFECT, (0.5, -1.0, 2.0, 0.4, 1.5), "refuted", "ruled out"),
    (EFFECT, (3.0, -4.0, 10.0, 0.3, 12.0), "inconclusive", "would be detected less than 80% of the time (MDE ±12.0)"),
    (EFFECT, (3.0, -INF, INF, 0.5, INF), "inconclusive", "too few seeds"),
    (EFFECT, (3.0, -1.0, 10.0, 0.2, 5.0), "inconclusive",
     "effects outside the 95% CI [-1.0, +10.0] are excluded, and an effect of ±5.0 would be detected 80% of the time"),
])
def test_verdict_rule_for_effect_claims(claim, ours, word, why):
    verdict = judge(claim, *ours)
    assert verdict.word == word and why in verdict.why
    assert "no effect larger" not in verdict.why  # the MDE is what power says, not what the data exclude


# (diff, lo, hi, p, mde, p of the equivalence test at the margin ±2)
@pytest.mark.parametrize("ours, word, why", [
    ((0.3, -1.2, 1.5, 0.6, 1.0, 0.001), "reproduced", "no difference that matters: equivalence test (TOST at ±2)"),
    ((-1.5, -1.9, -1.1, 0.001, 0.5, 0.003), "equivalent (a small difference)", "a real difference of -1.5"),
    ((3.5, 2.5, 5.0, 0.01, 2.0, 0.9), "refuted", "where the tutorial found none, the whole 95% CI beyond ±2"),
    ((3.5, 2.5, 5.0, 0.01, 2.0, 0.9), "refuted", "opposite in sign to the tutorial's (non-significant) -0.6"),
    # significant, but the CI reaches inside the margin (issue 47: not "refuted", not "equivalent")
    ((3.0, 1.0, 5.0, 0.01, 2.0, 0.9), "different (possibly inside the margin)", "reaches inside ±2"),
    ((-1.9, -2.5, -1.2, 0.01, 0.8, 0.2), "different (possibly inside the margin)", "not shown beyond the margin"),
    ((0.3, -2.5, 3.0, 0.7, 1.8, 0.3), "inconclusive", "the 95% CI [-2.5, +3.0] reaches beyond ±2"),
    ((0.3, -4.0, 5.0, 0.7, 4.0, 0.6), "inconclusive", "underpowered"),
])
def test_verdict_rule_for_null_claims(ours, word, why):
    verdict = judge(NULL, *ours)
    assert verdict.word == word and why in verdict.why


def test_a_null_claim_needs_the_equivalence_test():
    with pytest.raises(ValueError, match="equivalence"):
        judge(NULL, 0.3, -1.2, 1.5, 0.6, 1.0)


def test_a_missing_result_is_not_judged():
    with pytest.raises(ValueError):
        judge(EFFECT, NAN, NAN, NAN, NAN, NAN)


def _study_with_claims(tmp_path: Path, claims: list, name: str = "sweep_tiny") -> Path:
    raw = yaml.safe_load(TINY.read_text())
    raw.update(base=str((TINY.parent / raw["base"]).resolve()), name=name, seeds=10, claims=claims,
               expected_minutes=12)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


CLAIM = {"claim": "interleaved beats blocked", "variant": "interleaved",
         "tutorial": {"effect": 9.7, "ci": [7.6, 11.7], "p": 0.00195, "n": "10 paired seeds"}}


@pytest.mark.parametrize("change, message", [
    ({"variant": "blocked"}, "non-control variants"),
    ({"variant": "nope"}, "non-control variants"),
    ({"tutorial": {"effect": 1.0, "p": 0.3, "n": "3"}}, "needs `margin`"),
    ({"tutorial": {"effect": 1.0, "p": 0.0, "n": "3"}}, "tutorial.p"),
    ({"tutorial": {"effect": "big", "p": 0.01, "n": "3"}}, "must be a number"),
    ({"metric": "val/nothing"}, "not one of the study's metrics"),
    ({"colour": "red"}, "unknown key"),
])
def test_bad_claims_fail_at_load(tmp_path, change, message):
    path = _study_with_claims(tmp_path, [{**CLAIM, **change}])
    with pytest.raises(StudyError, match=message):
        load_study(path)


def _results(study, acc: dict[str, list[float]], out: Path) -> list[RunResult]:
    results = []
    for spec in plan_runs(study, out):
        value = acc[spec.variant][study.seeds.index(spec.seed)]
        results.append(RunResult(spec, "done", {"val/completion_acc": value, "val/loss": 2 - value}, wall_s=60.0))
    return results


ACC = {"blocked": [0.50 + 0.01 * i for i in range(10)],
       "interleaved": [0.55 + 0.01 * i + 0.004 * (-1) ** i for i in range(10)]}


def _row(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("| 1 |"))


def test_table_from_committed_results_matches_the_analysis(tmp_path):
    path = _study_with_claims(tmp_path, [CLAIM])
    study = load_study(path)
    runs, data = tmp_path / "runs", tmp_path / "data"
    results = _results(study, ACC, runs)
    write_results(data / "sweep_tiny.json", results_payload(study, results, "python -m ...", 600.0, 2))
    out = main(["--studies", str(path), "--runs", str(runs), "--data", str(data), "--out", str(tmp_path / "F.md")],
               log=lambda _m: None)
    row = _row(out.read_text())
    comp = analyse(study, results)[0].comparisons[0]
    assert comp.n == 10 and comp.p < 0.05
    assert f"{comp.mean_diff * 100:+.1f} [{comp.lo * 100:+.1f}, {comp.hi * 100:+.1f}]" in row
    assert f"MDE ±{comp.mde * 100:.1f}" in row and "n=10 seeds" in row
    assert "**reproduced**" in row and "smaller than the tutorial's" in row
    assert "10 min with 2 workers" in row  # the invocation ran all 20 runs in 600 s
    assert "+9.7 [+7.6, +11.7], p=0.002" in row


def test_no_results_read_not_run_and_stale_results_are_not_used(tmp_path):
    path = _study_with_claims(tmp_path, [CLAIM])
    runs, data = tmp_path / "runs", tmp_path / "data"
    args = ["--studies", str(path), "--runs", str(runs), "--data", str(data), "--out", str(tmp_path / "F.md")]
    row = _row(main(args, log=lambda _m: None).read_text())
    assert "| not run |" in row and "expected ≈12 min" in row
    other = load_study(path).with_settings({"trainer.max_steps": 50})  # a quick run: other fingerprints
    write_results(data / "sweep_tiny.json", results_payload(other, _results(other, ACC, runs), "", None, None))
    row = _row(main(args, log=lambda _m: None).read_text())
    assert "not run (the 20 saved runs are of other settings)" in row


def test_runs_directory_is_read_and_copied_to_the_committed_data(tmp_path):
    path = _study_with_claims(tmp_path, [CLAIM])
    study = load_study(path)
    runs, data = tmp_path / "runs", tmp_path / "data"
    results = _results(study, ACC, runs)
    for r in results[:12]:  # 6 seeds of each arm finished: a partial study
        r.spec.run_dir.mkdir(parents=True)
        (r.spec.run_dir / DONE_FILE).write_text(json.dumps(
            {"fingerprint": r.spec.fingerprint, "final": r.final, "wall_s": 60.0}))
    out = main(["--studies", str(path), "--runs", str(runs), "--data", str(data), "--out", str(tmp_path / "F.md")],
               log=lambda _m: None)
    row = _row(out.read_text())
    assert "n=6 seeds" in row and "partial: 12/20 runs" in row and "(so far)" in row
    assert "≈6 min with 2 workers" in row  # 12 runs x 60 s / 2 workers
    saved = json.loads((data / "sweep_tiny.json").read_text())
    assert len(saved["runs"]) == 12
    assert {r["fingerprint"] for r in saved["runs"]} == {r.spec.fingerprint for r in results[:12]}


def test_shipped_studies_all_state_their_claims():
    for name in STUDIES:
        study = load_study(EXPERIMENTS / f"{name}.yaml")
        assert study.claims and study.expected_minutes, name
        assert len(study.seeds) >= 3, name
        assert study.regime or not name.startswith("rl_"), f"{name}: every RL row names its regime"
        for claim in study.claims:
            assert claim.variant in {v.name for v in study.variants} - {study.control}
            assert claim.is_null == (claim.margin is not None)


# The two RL rows the old rule called "refuted" although their whole CI lies inside the ±5 margin (issue 31): per-seed
# differences built to give the same mean and interval, judged through the same code path as the table.
ROW4 = (-3.0 + np.linspace(-2.56, 2.56, 20)).tolist()  # n = 20: -3.0 [-3.8, -2.2]
_E = np.linspace(-1, 1, 16)
ROW6 = (-2.4 + 3.6 * _E - 3.0 * (_E ** 2 - np.mean(_E ** 2))).tolist()  # n = 16: -2.4 [-3.8, -1.1], skewed


@pytest.mark.parametrize("diffs, cell", [(ROW4, "-3.0 [-3.8, -2.2]"), (ROW6, "-2.4 [-3.8, -1.1]")])
def test_small_significant_difference_inside_the_margin_is_equivalent(tmp_path, diffs, cell):
    claim = {"claim": "no difference", "variant": "interleaved", "margin": 5.0,
             "tutorial": {"effect": 0.0, "p": 1.0, "n": "20 dev tasks"}}
    path = _study_with_claims(tmp_path, [claim])
    raw = yaml.safe_load(path.read_text())
    raw["seeds"] = len(diffs)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    study = load_study(path)
    control = [0.80 + 0.002 * i for i in range(len(diffs))]
    acc = {"blocked": control, "interleaved": [c + d / 100 for c, d in zip(control, diffs)]}
    runs, data = tmp_path / "runs", tmp_path / "data"
    write_results(data / "sweep_tiny.json", results_payload(study, _results(study, acc, runs), "", None, None))
    row = _row(main(["--studies", str(path), "--runs", str(runs), "--data", str(data), "--out",
                     str(tmp_path / "F.md")], log=lambda _m: None).read_text())
    assert cell in row
    p_tost = tost_sign_flip(diffs, 5.0)
    assert p_tost < 0.05 and f"TOST ±5: p={format_p(p_tost)}" in row
    assert "**equivalent (a small difference)**" in row and "inside ±5" in row


def test_equivalence_is_holm_adjusted_like_the_difference_tests():
    """Two comparisons: the equivalence p's are Holm-adjusted as a family, the same way as the difference p's."""
    from glm_lightning.sweep.findings import equivalence_p

    study = load_study(TINY)
    two = [Claim("a", "interleaved", 0.0, 1.0, "1", margin=5.0), Claim("b", "other", 0.0, 1.0, "1", margin=2.0)]
    study.claims = two
    diffs = {"interleaved": [0.01 * x for x in (-1.0, 0.5, 1.2, -0.3, 0.8, 0.1, -0.6, 0.4)],
             "other": [0.01 * x for x in (1.5, 0.2, 1.9, -0.4, 1.1, 0.7, 0.3, 1.6)]}

    class Comp:
        def __init__(self, variant):
            self.variant, self.diffs, self.n = variant, diffs[variant], 8

    class Analysis:
        metric = study.primary
        comparisons = [Comp("interleaved"), Comp("other")]

    raw = [tost_sign_flip([100 * d for d in diffs["interleaved"]], 5.0),
           tost_sign_flip([100 * d for d in diffs["other"]], 2.0)]
    assert equivalence_p(study, Analysis, two[0]) == pytest.approx((raw[0], holm(raw)[0]))
    assert equivalence_p(study, Analysis, two[1]) == pytest.approx((raw[1], holm(raw)[1]))
    assert holm(raw)[0] > raw[0]  # the adjustment is not a no-op here


def test_every_report_names_a_commit_in_the_repository_or_says_it_is_not():
    """Issue 31, part 4: a report's `code:` line names the commit its runs ran at; a commit that cannot be reached
    must be said to be missing (or the study re-run). The saved results behind the findings table too."""
    import re

    from glm_lightning.sweep.report import commit_in_repository
    from glm_lightning.sweep.study import REPO_ROOT

    if commit_in_repository("HEAD") is None:
        pytest.skip("not a git checkout: no commits to look up")
    results = REPO_ROOT / "docs" / "results"
    checked = 0
    for report in sorted(results.glob("*.md")):
        for line in report.read_text().splitlines():
            if not line.startswith("- code:"):
                continue
            for rev in re.findall(r"\b(?:git|at) `?([0-9a-f]{7,40})\b", line):
                checked += 1
                assert commit_in_repository(rev) or "not in this repository" in line, f"{report.name}: {rev}"
    assert checked >= 10
    table = (results / "README.md").read_text()
    for data in sorted((results / "data").glob("*.json")):
        rev = json.loads(data.read_text()).get("git", "")
        assert commit_in_repository(rev) or f"`{rev}` (**not in this repository**" in table, data.name
    assert commit_in_repository("0000000") is False


def test_a_commit_counts_only_when_the_checked_out_history_reaches_it(tmp_path):
    """A commit object that sits in the local store but off the checked-out history (a rebased branch's original)
    is not in a fresh clone, so it does not count as in the repository; one the history reaches does."""
    import subprocess

    from glm_lightning.sweep.report import commit_in_repository

    def git(*args: str) -> str:
        env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
               "GIT_COMMITTER_EMAIL": "t@t", "PATH": os.environ["PATH"], "HOME": str(tmp_path)}
        return subprocess.run(["git", *args], cwd=tmp_path, env=env, check=True, capture_output=True,
                              text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "a.txt").write_text("a")
    git("add", "a.txt")
    git("commit", "-q", "-m", "first")
    first = git("rev-parse", "HEAD")
    dangling = git("commit-tree", "HEAD^{tree}", "-p", first, "-m", "off the history")
    (tmp_path / "a.txt").write_text("b")
    git("commit", "-q", "-am", "second")
    assert commit_in_repository(first[:7], repo=tmp_path) is True
    assert commit_in_repository(git("rev-parse", "HEAD"), repo=tmp_path) is True
    assert commit_in_repository(dangling[:7], repo=tmp_path) is False
    assert commit_in_repository("0000000", repo=tmp_path) is False


def test_level_intervals_stay_within_0_and_100():
    """Issue 31, part 5: every shipped study's rate metric (shown as points) declares bounds, so its per-variant
    intervals are clipped to [0, 100]; and no committed report prints a level interval outside that range."""
    import re

    from glm_lightning.sweep.study import REPO_ROOT

    for path in sorted(EXPERIMENTS.glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        if not isinstance(raw, dict) or "metrics" not in raw:
            continue
        for metric in load_study(path).metrics:
            if metric.unit == "points" and metric.scale == 100:
                assert metric.bounds == (0.0, 1.0), f"{path.name}: {metric.tag} needs bounds: [0, 1]"
    checked = 0
    for report in sorted((REPO_ROOT / "docs" / "results").glob("*.md")):
        in_points = False  # a metric section of a rate shown as points ("shown as points = value x 100")
        for line in report.read_text().splitlines():
            if line.startswith("#"):
                in_points = "as points" in line
                continue
            cells = line.split(" | ")
            if in_points and len(cells) > 4 and re.fullmatch(r"\[-?[0-9.]+, -?[0-9.]+\]", cells[3]):
                lo, hi = (float(x) for x in cells[3][1:-1].split(", "))
                assert 0.0 <= lo <= hi <= 100.0, f"{report.name}: {line[:60]}"
                checked += 1
    assert checked >= 20


def test_a_partial_rerun_never_replaces_the_saved_results(tmp_path):
    """Issue 35: no command replaces a results file with less than it held. The saved copy has all 20 runs; a new
    runs directory with 4 of them leaves it as it was and the table keeps reading the 20."""
    path = _study_with_claims(tmp_path, [CLAIM])
    study = load_study(path)
    runs, data = tmp_path / "runs", tmp_path / "data"
    results = _results(study, ACC, runs)
    write_results(data / "sweep_tiny.json", results_payload(study, results, "python -m ...", 600.0, 2))
    before = (data / "sweep_tiny.json").read_bytes()
    for r in results[:4]:
        r.spec.run_dir.mkdir(parents=True)
        (r.spec.run_dir / DONE_FILE).write_text(json.dumps(
            {"fingerprint": r.spec.fingerprint, "final": r.final, "wall_s": 60.0}))
    row = _row(main(["--studies", str(path), "--runs", str(runs), "--data", str(data), "--out",
                     str(tmp_path / "F.md")], log=lambda _m: None).read_text())
    assert "n=10 seeds" in row and "partial: " not in row
    assert (data / "sweep_tiny.json").read_bytes() == before


OWN = Claim("1 stream learns as well as 4", "interleaved", effect=0.0, p=1.0, n="", margin=5.0, own=True)


@pytest.mark.parametrize("ours, word", [
    ((0.3, -1.2, 1.5, 0.6, 1.0, 0.001), "equivalent"),
    ((1.5, 0.8, 2.2, 0.002, 1.0, 0.001), "equivalent (a small difference)"),
    ((7.0, 5.5, 8.5, 0.002, 1.0, 0.4), "different (beyond the margin)"),
    ((6.0, 3.5, 8.5, 0.002, 1.0, 0.4), "different (possibly inside the margin)"),
    ((1.0, -6.0, 8.0, 0.5, 12.0, 0.3), "inconclusive"),
])
def test_the_labs_own_questions_use_their_own_words(ours, word):
    verdict = judge(OWN, *ours)
    assert verdict.word == word
    assert "tutorial" not in verdict.why


def test_an_own_question_needs_a_margin_and_gets_its_own_section(tmp_path):
    own = {"claim": "interleaved is as good as blocked", "variant": "interleaved"}
    with pytest.raises(StudyError, match="needs `margin`"):
        load_study(_study_with_claims(tmp_path, [own]))
    path = _study_with_claims(tmp_path, [CLAIM, {**own, "margin": 20.0}])
    study = load_study(path)
    assert [c.own for c in study.claims] == [False, True]
    runs, data = tmp_path / "runs", tmp_path / "data"
    write_results(data / "sweep_tiny.json", results_payload(study, _results(study, ACC, runs), "python -m ...", 600.0, 2))
    text = main(["--studies", str(path), "--runs", str(runs), "--data", str(data), "--out", str(tmp_path / "F.md")],
                log=lambda _m: None).read_text()
    tutorial_table, own_table = text.split("## The lab's own questions")
    assert "| 1 | interleaved beats blocked" in tutorial_table and "| 2 |" not in tutorial_table
    row = next(line for line in own_table.splitlines() if line.startswith("| 2 |"))
    assert "interleaved is as good as blocked" in row and "TOST ±20" in row
    assert "**equivalent (a small difference)**" in row  # +5.4 points, significant, inside ±20


def test_a_small_margin_prints_its_numbers_with_enough_decimals():
    bpb = Claim("bf16 reaches the same val bpb", "interleaved", effect=0.0, p=1.0, n="", margin=0.02, own=True,
                metric="val/loss")
    assert bpb.decimals == 3 and OWN.decimals == 1
    why = judge(bpb, 0.0123, 0.0051, 0.0197, 0.002, 0.004, 0.01).why
    assert "+0.012 [+0.005, +0.020]" in why and "±0.02" in why


def test_the_own_questions_put_the_architecture_ablations_in_their_own_section():
    """Issue 32: the findings table's own questions have an "Architecture" section (the ablation_* studies) apart from
    the other own questions (bf16 parity), in table order, and no empty section."""
    from types import SimpleNamespace

    from glm_lightning.sweep.findings import own_sections

    def row(study):
        return SimpleNamespace(study=SimpleNamespace(name=study))

    own = [(20, row("ablation_mhc")), (21, row("ablation_moe")), (22, row("bf16_parity"))]
    sections = own_sections(own)
    assert [title.split(":")[0] for title, _ in sections] == ["Architecture", "Numerics and settings"]
    assert [i for i, _ in sections[0][1]] == [20, 21] and [i for i, _ in sections[1][1]] == [22]
    assert [t for t, _ in own_sections(own[2:])] == ["Numerics and settings"]


def test_the_saved_results_keep_each_runs_evaluation_curve(tmp_path):
    """The committed data must redraw a study's curves once its (git-ignored) run folders are gone: the curve comes
    from the run's events, survives a reload of the saved file and a second save from it."""
    from torch.utils.tensorboard import SummaryWriter

    from glm_lightning.sweep.findings import from_saved

    study = load_study(_study_with_claims(tmp_path, [CLAIM]))
    runs, data = tmp_path / "runs", tmp_path / "data"
    results = _results(study, ACC, runs)
    first = results[0]
    with SummaryWriter(str(first.spec.run_dir)) as w:
        for step, value in ((49, 0.25), (99, 0.5), (149, 0.625)):
            w.add_scalar("val/completion_acc", value, step)
            w.add_scalar("train/other", 1.0, step)  # not a study metric: not saved
    payload = results_payload(study, results, "", None, None)
    assert payload["runs"][0]["curves"] == {"val/completion_acc": [[49, 0.25], [99, 0.5], [149, 0.625]]}
    assert payload["runs"][1]["curves"] == {}  # no folder, no events: no curve, not an error
    write_results(data / "sweep_tiny.json", payload)
    shutil.rmtree(runs)  # the run folders are gone
    saved = from_saved(study, data / "sweep_tiny.json", runs)
    again = results_payload(study, saved.results, "", None, None)
    assert again["runs"][0]["curves"] == payload["runs"][0]["curves"]


@pytest.mark.parametrize("name", STUDIES)
def test_committed_results_match_the_shipped_study_files(name, tmp_path):
    """A study's committed runs count only while its study and base config files are the ones they ran with (their
    identity): editing a shipped config without refreshing docs/results/data/<study>.json (`sweep findings` with the
    runs present) would silently turn its findings rows into "not run" on the next render."""
    from glm_lightning.sweep.findings import from_saved
    from glm_lightning.sweep.study import REPO_ROOT

    saved = REPO_ROOT / "docs" / "results" / "data" / f"{name}.json"
    if not saved.exists():
        pytest.skip(f"{name} has no committed results")
    study = load_study(EXPERIMENTS / f"{name}.yaml")
    out = from_saved(study, saved, tmp_path / "runs")
    assert out.rewritten == 0, f"{out.rewritten} committed runs of {name} carry a rewritten identity"
    assert out.stale == 0, f"{out.stale} committed runs of {name} no longer match its shipped config files"
    assert out.results, f"no committed run of {name} matches its shipped config files"


def test_the_findings_file_is_not_rewritten_when_only_its_date_would_change(tmp_path):
    from glm_lightning.sweep.findings import write_unless_only_the_date_changed

    out = tmp_path / "README.md"
    assert write_unless_only_the_date_changed(out, "| table |\n\n_Generated 2026-12-01 10:00._\n")
    before = out.read_bytes()
    assert not write_unless_only_the_date_changed(out, "| table |\n\n_Generated 2026-12-07 09:00._\n")
    assert out.read_bytes() == before, "byte for byte unchanged"
    assert write_unless_only_the_date_changed(out, "| new table |\n\n_Generated 2026-12-07 09:00._\n")
    assert "new table" in out.read_text()


def test_findings_twice_leave_the_tracked_table_byte_for_byte_unchanged(tmp_path):
    shipped = Path(__file__).resolve().parent.parent / "docs" / "results" / "README.md"
    out = tmp_path / "README.md"
    out.write_bytes(shipped.read_bytes())
    logs: list[str] = []
    main(["--runs", str(tmp_path / "no_runs"), "--out", str(out)], log=logs.append)
    assert out.read_bytes() == shipped.read_bytes(), "regenerating the committed findings changed more than the date"
    assert any("unchanged" in line for line in logs)


def test_the_table_states_table_wide_error_control(tmp_path):
    """Issue 47: the table says that no table-wide error control is possible at its seed counts and which rows
    survive Holm over every row's p (recomputed here from the rows' own p's)."""
    from glm_lightning.stats import holm
    from glm_lightning.sweep.findings import STUDIES, build_rows, table_wide_note

    studies = [load_study(EXPERIMENTS / f"{s}.yaml") for s in STUDIES]
    rows, _ = build_rows(studies, tmp_path / "runs", EXPERIMENTS.parents[1] / "docs" / "results" / "data", save=False)
    tested = [(i, r.comparison.p) for i, r in enumerate(rows, 1) if r.comparison is not None and r.comparison.n]
    survivors = [str(i) for (i, _), p in zip(tested, holm([p for _, p in tested])) if p < 0.05]
    note = table_wide_note(rows)
    assert f"Over all {len(tested)} rows" in note and "no table-wide error control is possible" in note
    assert f"whole table: {', '.join(survivors) if survivors else 'none'};" in note
