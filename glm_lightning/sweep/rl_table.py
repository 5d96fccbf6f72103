"""The report of the tutorial-size RL study (`configs/experiments/rl_tutorial_size.yaml`, issue 18 part 2):
`docs/results/rl_tutorial_size.md`, from the finished runs of its sweep.

    python -m glm_lightning sweep --config configs/experiments/rl_tutorial_size.yaml --workers 1 --set ...
    python -m glm_lightning.sweep.rl_table [--config STUDY] [--out runs/sweeps] [--report docs/results/...] [--set ...]

It puts the tutorial's confirmation table next to ours (mean over seeds and per seed, counts as x/N), from each
run's own before -> after measurement: `regression_report.json` of the RegressionCallback (per-task greedy and
sampled outcomes on the confirm split, before and after) and the dev curve of the PassAtKCallback (`start/dev/...`,
`dev/...` scalars). Reused, not rewritten: the sweep's run planning and DONE.json records (`runner`), its paired
RLOO-vs-GRPO analysis and report sections (`analysis`, `report`), the callback's counts (`summary_counts`) and
per-family exact McNemar + Holm (`compare_families`), and the McNemar power calculation (`power.mcnemar_mde`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from callbacks.regression import Measurement, compare_families, summary_counts
from glm_lightning.power import POWER, mcnemar_mde
from glm_lightning.stats import format_p
from glm_lightning.sweep.analysis import analyse
from glm_lightning.sweep.cli import DEFAULT_OUT, parse_settings, recorded_arguments
from glm_lightning.sweep.events import read_scalars
from glm_lightning.sweep.report import metric_section, power_lines, git_revision
from glm_lightning.sweep.runner import RunResult, plan_runs, read_done
from glm_lightning.sweep.study import REPO_ROOT, Study, StudyError, load_study

DEFAULT_STUDY = "configs/experiments/rl_tutorial_size.yaml"
DEFAULT_REPORT = "docs/results/rl_tutorial_size.md"
DEV_TAG = "dev"

MEASURES = {
    "greedy_trained": "greedy pass, trained families",
    "sampled_trained": "sampled exact completions, trained families",
    "pass_trained": "pass@8, trained families",
    "pass_all": "pass@8, all families",
    "dev_exact": "dev exact-rollout rate",
}
TUTORIAL: dict[str, tuple[int, int, int]] = {  # (before, after, N): tutorial-baseline.md section 6
    "greedy_trained": (0, 16, 24),
    "sampled_trained": (13, 88, 192),
    "pass_trained": (9, 19, 24),
    "pass_all": (25, 34, 64),
    "dev_exact": (4, 44, 96),
}
Counts = dict[str, tuple[int, int, int]]
"""measure -> (before, after, N)."""


@dataclass
class RunTable:
    """One finished run's numbers for the report."""

    variant: str
    seed: int
    counts: Counts
    baseline: Measurement
    final: Measurement
    roles: dict[str, str]
    n_samples: int
    wall_s: float = math.nan
    run_s: float = math.nan
    dev_curve: list[tuple[int, int]] = field(default_factory=list)


# --- one run ---------------------------------------------------------------------------------------------------------
def _last(scalars: dict[str, list[tuple[int, float]]], tag: str) -> float:
    points = scalars.get(tag) or []
    return points[-1][1] if points else math.nan


def run_counts(report: dict[str, Any], scalars: dict[str, list[tuple[int, float]]]) -> tuple[Counts, dict[str, str]]:
    """The tutorial's measures of one run from its regression_report.json and scalars (see the module doc)."""
    roles = {fam: row["role"] for fam, row in report["final"]["families"].items()}
    n = int(report["n_samples"])
    if n <= 0 or not report.get("final_measurement"):
        raise ValueError("the regression report has no sampled outcomes (n_samples = 0) or no final measurement")
    before = summary_counts(report["baseline"], roles, n)
    after = summary_counts(report["final_measurement"], roles, n)
    trained = "rewarded"
    counts: Counts = {
        "greedy_trained": (before[trained]["greedy_pass"], after[trained]["greedy_pass"], before[trained]["tasks"]),
        "sampled_trained": (before[trained]["sampled_exact"], after[trained]["sampled_exact"],
                            before[trained]["samples"]),
        "pass_trained": (before[trained][f"pass@{n}"], after[trained][f"pass@{n}"], before[trained]["tasks"]),
        "pass_all": (before["all"][f"pass@{n}"], after["all"][f"pass@{n}"], before["all"]["tasks"]),
    }
    dev_before = _last(scalars, f"start/{DEV_TAG}/sampled_exact")
    dev_after = _last(scalars, f"{DEV_TAG}/sampled_exact")
    dev_total = _last(scalars, f"{DEV_TAG}/sampled_total")
    if not any(math.isnan(v) for v in (dev_before, dev_after, dev_total)):
        counts["dev_exact"] = (round(dev_before), round(dev_after), round(dev_total))
    return counts, roles


def load_runs(study: Study, out: Path) -> tuple[list[RunTable], list[RunResult], list[str]]:
    """Every finished run of the study under `out` (DONE.json with matching settings), as RunTables and as the
    sweep's RunResults (for the paired analysis); plus a note per run that is missing or unreadable."""
    tables, results, missing = [], [], []
    for spec in plan_runs(study, out):
        done = read_done(spec)
        if done is None:
            missing.append(f"{spec.key}: not finished (no DONE.json for these settings in {spec.run_dir})")
            results.append(RunResult(spec, "cancelled"))
            continue
        results.append(RunResult(spec, "skipped", done.get("final", {}), done.get("steps", {}),
                                 float(done.get("wall_s", math.nan))))
        path = spec.run_dir / "regression_report.json"
        try:
            report = json.loads(path.read_text())
            scalars = read_scalars(spec.run_dir)
            counts, roles = run_counts(report, scalars)
        except (OSError, ValueError, KeyError) as err:
            missing.append(f"{spec.key}: unreadable ({type(err).__name__}: {err})")
            continue
        curve = [(step, round(v)) for step, v in scalars.get(f"{DEV_TAG}/sampled_exact", [])]
        tables.append(RunTable(spec.variant, spec.seed, counts, report["baseline"], report["final_measurement"],
                               roles, int(report["n_samples"]), float(done.get("wall_s", math.nan)),
                               _last(scalars, "time/run_s"), curve))
    return tables, results, missing


# --- formatting ------------------------------------------------------------------------------------------------------
def _pct(x: float, n: int) -> str:
    return f"{100 * x / n:.1f}%" if n else "n/a"


def count_cell(before: float, after: float, n: int, digits: int = 0) -> str:
    """`x/N (p%) → y/N (q%)`, the tutorial's notation (means over seeds with one decimal)."""
    fmt = f"{{:.{digits}f}}"
    return f"{fmt.format(before)}/{n} ({_pct(before, n)}) → {fmt.format(after)}/{n} ({_pct(after, n)})"


def mean_counts(runs: Sequence[RunTable], measure: str) -> tuple[float, float, int] | None:
    rows = [r.counts[measure] for r in runs if measure in r.counts]
    if not rows or len({n for _, _, n in rows}) != 1:
        return None
    return statistics.mean(b for b, _, _ in rows), statistics.mean(a for _, a, _ in rows), rows[0][2]


def table_section(study: Study, runs: Sequence[RunTable]) -> list[str]:
    """The tutorial's table with ours beside it: mean over seeds per variant, then every run."""
    names = [v.name for v in study.variants]
    by_variant = {name: [r for r in runs if r.variant == name] for name in names}
    head = ["measure", "tutorial (1 run)"] + [f"{name} (mean of {len(by_variant[name])} seed{'' if len(by_variant[name]) == 1 else 's'})"
                                                for name in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, label in MEASURES.items():
        b, a, n = TUTORIAL[key]
        row = [label, count_cell(b, a, n)]
        for name in names:
            m = mean_counts(by_variant[name], key)
            row.append("n/a" if m is None else count_cell(*m, digits=1))
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Every run (before → after, the run's own measurement of its start checkpoint and of its result):",
              ""]
    ordered = sorted(runs, key=lambda r: (names.index(r.variant), study.seeds.index(r.seed)))
    head = ["measure"] + [f"{r.variant} seed {r.seed}" for r in ordered]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, label in MEASURES.items():
        cells = [count_cell(*r.counts[key]) if key in r.counts else "n/a" for r in ordered]
        lines.append("| " + " | ".join([label, *cells]) + " |")
    walls = [f"{r.wall_s / 60:.1f} min" if math.isfinite(r.wall_s) else "n/a" for r in ordered]
    lines.append("| " + " | ".join(["wall time (subprocess)", *walls]) + " |")
    inner = [f"{r.run_s / 60:.1f} min" if math.isfinite(r.run_s) else "n/a" for r in ordered]
    lines.append("| " + " | ".join(["wall time (fit start → train end, `time/run_s`)", *inner]) + " |")
    curves = [", ".join(f"{v}" for _, v in r.dev_curve) or "n/a" for r in ordered]
    lines.append("| " + " | ".join(["dev curve: exact rollouts at each evaluation", *curves]) + " |")
    return lines + [""]


def family_counts(measurement: Measurement, n_samples: int) -> dict[str, tuple[int, int, int]]:
    """family -> (exact samples, tasks with a passing sample, tasks): the tutorial's per-family sampled table."""
    out = {}
    for fam, m in measurement.items():
        exact = [round(float(v) * n_samples) for v in m.get("sampled", [])]
        out[fam] = (sum(exact), sum(e > 0 for e in exact), len(m["greedy"]))
    return out


def family_section(study: Study, runs: Sequence[RunTable]) -> list[str]:
    """Per family, mean over the seeds of each variant: exact samples and pass@n, before -> after (the tutorial's
    "per family, sampled" table)."""
    if not runs:
        return []
    names = [v.name for v in study.variants]
    n = runs[0].n_samples
    head = ["family", "trained"] + [f"{name}: exact samples" for name in names] + [f"{name}: pass@{n}" for name in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for fam, role in runs[0].roles.items():
        exact_cells, pass_cells = [], []
        for name in names:
            mine = [r for r in runs if r.variant == name]
            if not mine:
                exact_cells.append("n/a")
                pass_cells.append("n/a")
                continue
            before = [family_counts(r.baseline, r.n_samples)[fam] for r in mine]
            after = [family_counts(r.final, r.n_samples)[fam] for r in mine]
            tasks = before[0][2]
            exact_cells.append(f"{statistics.mean(b[0] for b in before):.1f} → {statistics.mean(a[0] for a in after):.1f}"
                               f" of {tasks * n}")
            pass_cells.append(f"{statistics.mean(b[1] for b in before):.1f} → {statistics.mean(a[1] for a in after):.1f}"
                              f" of {tasks}")
        lines.append("| " + " | ".join([fam, "yes" if role == "rewarded" else "no", *exact_cells, *pass_cells]) + " |")
    return lines + [""]


def _join(measurement: Measurement, families: Sequence[str]) -> dict[str, list[float]]:
    return {key: [v for f in families for v in measurement[f].get(key, [])] for key in ("greedy", "sampled")}


def regression_section(study: Study, runs: Sequence[RunTable], alpha: float = 0.05) -> list[str]:
    """Per-family greedy changes on the untrained families, exact McNemar + Holm across them, per run; the greedy
    change of the trained families pooled (the tutorial's 16 gains / 0 losses, p = 3.05e-5); MDE per family."""
    if not runs:
        return ["No finished run.", ""]
    roles = runs[0].roles
    untrained = [f for f, role in roles.items() if role != "rewarded"]
    trained = [f for f, role in roles.items() if role == "rewarded"]
    names = [v.name for v in study.variants]
    ordered = sorted(runs, key=lambda r: (names.index(r.variant), study.seeds.index(r.seed)))
    lines = [f"Greedy pass per task before → after on the {len(untrained)} untrained families; exact McNemar test on "
             f"the discordant tasks (losses = passed before and failed after), Holm-adjusted across the "
             f"{len(untrained)} families within each run; **REGRESSION** = Holm p ≤ {alpha} with more losses "
             "than gains.", ""]
    head = ["family"] + [f"{r.variant} seed {r.seed}" for r in ordered]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    reports = [compare_families({f: r.baseline[f] for f in untrained}, {f: r.final[f] for f in untrained},
                                alpha=alpha, n_boot=2000, roles=r.roles) for r in ordered]
    for fam in untrained:
        cells = []
        for rep in reports:
            row = rep["families"][fam]
            n = row["n_tasks"]
            b, a = round(row["baseline_greedy"] * n), round(row["current_greedy"] * n)
            verdict = " **REGRESSION**" if row["regression"] else (" improved" if row["improvement"] else "")
            cells.append(f"{b}/{n} → {a}/{n}; {row['losses']} lost / {row['gains']} gained; p {format_p(row['p_mcnemar'])}, "
                         f"Holm {format_p(row['p_holm'])}{verdict}")
        lines.append("| " + " | ".join([fam, *cells]) + " |")
    pooled = [compare_families({"trained": _join(r.baseline, trained)}, {"trained": _join(r.final, trained)},
                               alpha=alpha, n_boot=2000)["families"]["trained"] for r in ordered]
    cells = [f"{round(p['baseline_greedy'] * p['n_tasks'])}/{p['n_tasks']} → "
             f"{round(p['current_greedy'] * p['n_tasks'])}/{p['n_tasks']}; {p['gains']} gained / {p['losses']} lost; "
             f"p {format_p(p['p_mcnemar'])}" for p in pooled]
    lines.append("| " + " | ".join([f"trained ({', '.join(trained)}), pooled", *cells]) + " |")
    flagged = sorted({f for rep in reports for f in rep["flagged"]})
    lines += ["", ("Significant regressions: " + ", ".join(
        f"{f} in {sum(f in rep['flagged'] for rep in reports)}/{len(reports)} runs" for f in flagged) + ".")
              if flagged else "No significant regression on an untrained family in any run.", ""]
    lines += mde_lines(reports, untrained, alpha)
    return lines


def mde_lines(reports: Sequence[dict[str, Any]], families: Sequence[str], alpha: float = 0.05) -> list[str]:
    """Minimum detectable change of a family's greedy pass rate at 80% power (exact McNemar at Holm's first-step
    alpha / m), at the discordance observed in these runs, and at a few reference discordances."""
    m = max(1, len(families))
    a = alpha / m
    n = reports[0]["families"][families[0]]["n_tasks"] if families else 0
    lines = [f"**Power** (exact McNemar, n = {n} tasks per family, two-sided alpha {alpha}/{m} = {a:.3g}, Holm's "
             f"first step; {POWER:.0%} power). The MDE depends on the share of tasks that change outcome "
             "(discordant), which the runs estimate:", ""]
    lines += ["| family | discordant tasks (mean over runs) | MDE of the pass-rate change |", "|---|---:|---:|"]
    for fam in families:
        disc = statistics.mean((r["families"][fam]["losses"] + r["families"][fam]["gains"]) / n for r in reports)
        mde = mcnemar_mde(n, disc, alpha=a) if disc > 0 else math.inf
        cell = "none: no task changed" if disc == 0 else (
            "none: underpowered" if math.isinf(mde) else f"±{100 * mde:.1f} points ({mde * n:.1f} tasks)")
        lines.append(f"| {fam} | {disc * n:.1f}/{n} | {cell} |")
    ref = []
    for d in (0.1, 0.2, 0.3, 0.5):
        mde = mcnemar_mde(n, d, alpha=a)
        ref.append(f"{d:.0%} discordant: " + ("none" if math.isinf(mde) else f"±{100 * mde:.1f} points"))
    lines += ["", f"For reference, with {n} tasks: " + "; ".join(ref) + ". A family with no significant change "
              "therefore shows no drop larger than its MDE, or was underpowered where the MDE is none.", ""]
    return lines


def write_table_report(study: Study, out: Path, report_path: Path, reproduce: str) -> Path:
    """Write the Markdown report; returns its path."""
    runs, results, missing = load_runs(study, out)
    if not runs:
        raise StudyError(f"no finished run of {study.name} in {Path(out).resolve() / study.name} for these settings "
                         f"({len(missing)} missing or unreadable); {report_path} left as it was")
    lines = ["# RL at the tutorial's size: RLOO vs GRPO", "",
             "Issue 18, part 2: our runs next to the tutorial's final RL run (`tutorial-baseline.md` §6.2-6.3).", "",
             study.description or "", "",
             "## The tutorial's table and ours", "",
             f"Ours evaluates {_tasks_per_family(runs)} confirm tasks per family (the tutorial: 8), so N differs; "
             "compare the rates. Before = the start checkpoint measured at the start of each run, after = the same "
             "tasks at the end.", ""]
    lines += table_section(study, runs)
    lines += ["## Per family, sampled (mean over seeds)", ""] + family_section(study, runs)
    lines += ["## Regressions on the untrained families", ""] + regression_section(study, runs)
    analyses = analyse(study, results)
    lines += ["## RLOO vs GRPO (paired by seed)", ""] + power_lines(study, analyses[0])
    for i, a in enumerate(analyses):
        lines += metric_section(study, a, primary=i == 0)
    lines += ["## Setup", "",
              f"- study: `{_rel(study.path)}`, base config `{_rel(study.base)}`; runs under `{_rel(out / study.name)}`",
              f"- variants: {', '.join(v.name for v in study.variants)} (control {study.control}); seeds "
              f"{study.seeds} (as " + ", ".join(f"`{k}`" for k in study.seed_keys) + ")",
              f"- finished runs: {len(runs)} of {len(study.variants) * len(study.seeds)}",
              f"- code: git {git_revision()}", ""]
    if study.budget:
        lines += [f"- budget: {study.budget}", ""]
    if missing:
        lines += ["Missing or unreadable runs:", ""] + [f"- {m}" for m in missing] + [""]
    lines += ["## Reproduce", "", "```", reproduce, "```", ""]
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text("\n".join(lines))
    return report_path


def _tasks_per_family(runs: Sequence[RunTable]) -> str:
    sizes = sorted({len(m["greedy"]) for r in runs for m in r.final.values()})
    return "/".join(map(str, sizes)) or "n/a"


def _rel(path: Path) -> str:
    path = Path(path).resolve()
    try:
        return str(path.relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def main(argv: Sequence[str] | None = None) -> Path:
    p = argparse.ArgumentParser(prog="python -m glm_lightning.sweep.rl_table",
                                description="Write the tutorial-size RL report from a finished sweep.")
    p.add_argument("--config", default=DEFAULT_STUDY, help=f"study YAML ({DEFAULT_STUDY})")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"the sweep's output root ({DEFAULT_OUT})")
    p.add_argument("--report", default=DEFAULT_REPORT, help=f"Markdown file to write ({DEFAULT_REPORT})")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                   help="the same --set settings the sweep ran with (they are part of each run's fingerprint)")
    args = p.parse_args(argv)
    try:
        study = load_study(args.config)
        saved = recorded_arguments((Path(args.out) / study.name).resolve())
        if not args.settings and saved and isinstance(saved.get("settings"), list):
            args.settings = [str(x) for x in saved["settings"]]  # the settings of the sweep that wrote the folder
        if saved and isinstance(saved.get("seeds"), int):
            study = study.with_seed_count(saved["seeds"])
        if args.settings:
            study = study.with_settings(parse_settings(args.settings))
        sets = " ".join(f"--set {s}" for s in args.settings)
        reproduce = (f"python -m glm_lightning sweep --config {args.config} --workers 1 --out {args.out} {sets}\n"
                     f"python -m glm_lightning.sweep.rl_table --config {args.config} --out {args.out} "
                     f"--report {args.report} {sets}").replace("  ", " ")
        path = write_table_report(study, Path(args.out), Path(args.report), reproduce)
    except StudyError as err:
        print(f"rl_table: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"[rl_table] wrote {path}")
    return path


if __name__ == "__main__":
    main()
