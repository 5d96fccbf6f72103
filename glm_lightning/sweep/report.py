"""Study outputs: REPORT.md, PNG charts (learning curves with CI bands, paired-seed dot plots) and a TensorBoard
hparams view (one entry per run with its final metrics)."""

from __future__ import annotations

import math
import shutil
import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from glm_lightning.power import POWER
from glm_lightning.stats import EXACT_SIGN_FLIP_MAX_N, format_p, min_attainable_p, underpowered_text
from glm_lightning.sweep.analysis import Comparison, Curves, MetricAnalysis, curve_band, metric_bounds
from glm_lightning.sweep.fingerprint import file_digest, git_revision, referenced_files, source_digest
from glm_lightning.sweep.runner import RunResult
from glm_lightning.sweep.study import REPO_ROOT, Metric, Study, overrides_to_args

TRAIN_CURVE_TAG = "train/loss"


def _fmt(x: float, metric: Metric, sign: bool = False) -> str:
    if x is None or math.isnan(x):
        return "n/a"
    digits = 1 if metric.scale >= 10 else 3
    v = x * metric.scale
    return f"{v:+.{digits}f}" if sign else f"{v:.{digits}f}"


def _ci(lo: float, hi: float, metric: Metric) -> str:
    if math.isnan(lo) or math.isnan(hi):
        return "n/a"
    if math.isinf(lo) or math.isinf(hi):
        return "none (exact test only)"
    return f"[{_fmt(lo, metric)}, {_fmt(hi, metric)}]"


def _mde_cell(c: Comparison, metric: Metric) -> str:
    """The minimum detectable effect in the metric's display units, or why there is none."""
    if math.isinf(c.mde):
        return "none: underpowered"
    if math.isnan(c.mde):
        return "n/a"
    return "±" + _fmt(c.mde, metric)


def _range_note(metric: Metric, a: MetricAnalysis) -> str:
    values = [v for s in a.summaries.values() for v in s.values.values()]
    bounds = metric_bounds(metric, values)
    if bounds is None:
        return ""
    return f", clipped to [{bounds[0] * metric.scale:g}, {bounds[1] * metric.scale:g}]"


def commit_in_repository(rev: str, repo: Path = REPO_ROOT) -> bool | None:
    """Whether `rev` (a hash as reports record it) names a commit in this repository's history, i.e. one the
    checked-out commit descends from (a commit that lives only in a local object store, a rebased branch's
    original say, is absent from a fresh clone); None when no git repository can be asked (an unpacked copy).
    A report whose commit is not there must say so (or be re-run)."""
    rev = rev.split()[0].rstrip(",") if rev.split() else ""
    if not rev or rev == "unknown":
        return False
    try:
        proc = subprocess.run(["git", "merge-base", "--is-ancestor", rev, "HEAD"], cwd=repo,
                              capture_output=True, timeout=10)
        inside = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=repo, capture_output=True,
                                text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if inside.returncode != 0:
        return None
    return proc.returncode == 0


def runs_commit(results: Sequence[RunResult]) -> str:
    """The commit the runs ran at, as each recorded it when it finished: one hash, or several joined by ", "; empty
    when none recorded one (runs finished before runs kept their commit)."""
    return ", ".join(sorted({r.git for r in results if r.git}))


def runs_code(results: Sequence[RunResult]) -> str:
    """The report's code line: which commit(s) the runs ran at, and how many recorded none."""
    by_rev: dict[str, int] = {}
    for r in results:
        by_rev[r.git] = by_rev.get(r.git, 0) + 1
    parts = [f"git {rev} ({n} run{'s' if n != 1 else ''})" for rev, n in sorted(by_rev.items()) if rev]
    if by_rev.get(""):
        parts.append(f"{by_rev['']} run(s) recorded no commit (finished before runs recorded theirs)")
    return "runs at " + ("; ".join(parts) if parts else "no recorded commit")


# --- charts ----------------------------------------------------------------------------------------------------------
def _figure(n_panels: int, width: float = 5.0, height: float = 3.6) -> Any:
    from matplotlib.figure import Figure

    cols = min(3, n_panels)
    rows = math.ceil(n_panels / cols)
    fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(n_panels)]
    return fig, axes


def plot_curves(study: Study, curves: Curves, tags: Sequence[str], path: Path, confidence: float = 0.95) -> Path:
    """One panel per tag: mean across seeds per variant with a t-interval band."""
    fig, axes = _figure(len(tags))
    metric_of = {m.tag: m for m in study.metrics}
    for ax, tag in zip(axes, tags):
        scale = metric_of[tag].scale if tag in metric_of else 1.0
        observed = [v for var in study.variants for pts in curves[var.name].get(tag, {}).values() for _, v in pts]
        bounds = metric_bounds(metric_of[tag], observed) if tag in metric_of else None
        for i, variant in enumerate(study.variants):
            steps, mean, lo, hi = curve_band(curves[variant.name].get(tag, {}), confidence, bounds)
            if not steps:
                continue
            n = len(curves[variant.name][tag])
            colour = f"C{i}"
            label = f"{variant.name} (n={n})" + (" [control]" if variant.name == study.control else "")
            ax.plot(steps, [m * scale for m in mean], color=colour, marker="o" if len(steps) < 12 else None,
                    markersize=3, label=label)
            ax.fill_between(steps, [v * scale for v in lo], [v * scale for v in hi], color=colour, alpha=0.2,
                            linewidth=0)
        ax.set_title(tag + (f" (x{scale:g})" if scale != 1 else ""))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{study.name}: mean across seeds, {confidence:.0%} t-interval band (rates clipped to their range)")
    fig.savefig(path, dpi=110)
    return path


def plot_paired(study: Study, analysis: MetricAnalysis, path: Path) -> Path:
    """One panel per comparison: each seed's control and variant values joined by a line (green = variant better)."""
    comps = analysis.comparisons or []
    fig, axes = _figure(max(1, len(comps)), width=4.2, height=4.0)
    metric = analysis.metric
    ctrl = analysis.summaries[study.control].values
    for ax, comp in zip(axes, comps):
        var = analysis.summaries[comp.variant].values
        for seed in comp.seeds:
            a, b = ctrl[seed] * metric.scale, var[seed] * metric.scale
            better = (b > a) == metric.higher_is_better and a != b
            ax.plot([0, 1], [a, b], color="tab:green" if better else "tab:red", alpha=0.6, marker="o", markersize=4)
        if comp.seeds:
            ax.plot([0, 1], [sum(ctrl[s] for s in comp.seeds) / comp.n * metric.scale,
                             sum(var[s] for s in comp.seeds) / comp.n * metric.scale],
                    color="black", linewidth=2.5, marker="D", label="mean")
        ax.set_xticks([0, 1], [f"{study.control}\n(control)", comp.variant])
        ax.set_xlim(-0.3, 1.3)
        ax.set_title(f"{comp.variant} - {study.control}: {_fmt(comp.mean_diff, metric, sign=True)}"
                     f" {metric.unit}\n{comp.wins}/{comp.n} seeds better, p={format_p(comp.p)}", fontsize=9)
        ax.set_ylabel(metric.tag + (f" (x{metric.scale:g})" if metric.scale != 1 else ""))
        ax.grid(alpha=0.3)
    fig.suptitle(f"{study.name}: paired seeds, {metric.tag}")
    fig.savefig(path, dpi=110)
    return path


# --- TensorBoard hparams ---------------------------------------------------------------------------------------------
def _hparam_value(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)):
        return value
    return "null" if value is None else str(value)


def write_hparams(study: Study, results: Sequence[RunResult], out_dir: Path) -> Path:
    """`<out>/hparams/<variant>/seed<k>`: one hparams entry per finished run (variant, seed, its overrides) with the
    final value of every study metric; open with `tensorboard --logdir <out>/hparams` -> HPARAMS tab."""
    from torch.utils.tensorboard import SummaryWriter

    hp_dir = out_dir / "hparams"
    if hp_dir.exists():
        shutil.rmtree(hp_dir)
    keys = sorted({k for v in study.variants for k in v.overrides})
    writer = SummaryWriter(log_dir=str(hp_dir))
    try:
        for res in results:
            if not res.ok:
                continue
            variant = study.variant(res.spec.variant)
            hp = {"variant": variant.name, "seed": res.spec.seed}
            hp.update({k: _hparam_value(variant.overrides.get(k, "(base)")) for k in keys})
            metrics = {f"final/{m.tag}": res.final[m.tag] for m in study.metrics if m.tag in res.final}
            writer.add_hparams(hp, metrics, hparam_domain_discrete={"variant": [v.name for v in study.variants]},
                               run_name=f"{variant.name}/seed{res.spec.seed}")
    finally:
        writer.close()
    return hp_dir


# --- REPORT.md -------------------------------------------------------------------------------------------------------
def metric_section(study: Study, a: MetricAnalysis, primary: bool) -> list[str]:
    """One metric's section of a report: per-seed values, paired comparisons with the control, charts' captions."""
    m = a.metric
    shown = f"; shown as {m.unit or 'value'} = value x {m.scale:g}" if m.scale != 1 else ""
    lines = [f"## {'Primary' if primary else 'Secondary'} metric: `{m.tag}` "
             f"({'higher' if m.higher_is_better else 'lower'} is better{shown})", ""]
    lines += [f"| variant | n | mean across seeds | 95% CI (t{_range_note(m, a)}) | mean paired diff vs control "
              f"| 95% CI (inverted sign-flip test) | p (sign-flip) | Holm p | MDE ({POWER:.0%} power) | seeds better "
              f"| verdict |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    comp_of = {c.variant: c for c in a.comparisons}
    for variant in study.variants:
        s = a.summaries[variant.name]
        row = [f"**{variant.name}** (control)" if variant.name == study.control else variant.name, str(s.n),
               _fmt(s.mean, m), _ci(s.lo, s.hi, m)]
        c = comp_of.get(variant.name)
        if c is None:
            row += ["—"] * 7
        else:
            row += [_fmt(c.mean_diff, m, sign=True), _ci(c.lo, c.hi, m), format_p(c.p), format_p(c.p_holm),
                    _mde_cell(c, m), f"{c.wins}/{c.n}", c.verdict]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    return lines


def power_lines(study: Study, a: MetricAnalysis) -> list[str]:
    """What this study could detect: the MDE of each comparison of the primary metric, or why it has none."""
    m, comps = a.metric, a.comparisons
    if not comps:
        return []
    unit = f" {m.unit}" if m.unit else ""
    n_tests = len([c for c in comps if not math.isnan(c.p)])
    lines = [f"**Power** (exact sign-flip test, two-sided alpha 0.05"
             + (f", Holm across {n_tests} comparisons: alpha/{n_tests} for the MDE" if n_tests > 1 else "") + "):", ""]
    for c in comps:
        weak = underpowered_text(c.n, 0.05, max(1, n_tests))
        if weak is not None:
            lines.append(f"- {c.variant} vs {c.control}: {weak}.")
        elif math.isinf(c.mde):
            lines.append(f"- {c.variant} vs {c.control}: underpowered: with n={c.n} paired seeds no effect within the "
                         f"metric's range reaches {POWER:.0%} power (SD of the paired differences "
                         f"{_fmt(c.sd_diff, m)}{unit}).")
        elif math.isnan(c.mde):
            lines.append(f"- {c.variant} vs {c.control}: MDE not computable (n={c.n}, SD of the paired differences "
                         f"{_fmt(c.sd_diff, m)}).")
        else:
            lines.append(f"- {c.variant} vs {c.control}: with n={c.n} paired seeds the minimum detectable effect at "
                         f"{POWER:.0%} power is ±{_fmt(c.mde, m)}{unit} ({c.mde / c.sd_diff:.2f} x the SD of the "
                         f"paired differences, {_fmt(c.sd_diff, m)}{unit}).")
    return lines + [""]


def _per_seed_table(study: Study, a: MetricAnalysis) -> list[str]:
    m = a.metric
    names = [v.name for v in study.variants]
    others = [n for n in names if n != study.control]
    head = ["seed"] + names + [f"{n} - {study.control}" for n in others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for seed in study.seeds:
        vals = [a.summaries[n].values.get(seed) for n in names]
        row = [str(seed)] + ["missing" if v is None else _fmt(v, m) for v in vals]
        ctrl = a.summaries[study.control].values.get(seed)
        for n in others:
            v = a.summaries[n].values.get(seed)
            row.append("n/a" if v is None or ctrl is None else _fmt(v - ctrl, m, sign=True))
        lines.append("| " + " | ".join(row) + " |")
    return lines + [""]


START_TAG_PREFIX = "start/"
"""Scalars logged before the first training step (PassAtKCallback(evaluate_at_start=True)): a run's start level."""


def block_section(study: Study, a: MetricAnalysis, results: Sequence[RunResult]) -> list[str]:
    """Blocks (e.g. one start checkpoint each): what each block's overrides load (path and sha256 of every
    checkpoint), its level before training (the runs' `start/...` scalars), and the paired difference of every arm
    within the block. Pairs never cross blocks (each seed belongs to one), so the pooled test above compares arms
    within blocks; the per-block means show whether the blocks agree."""
    m = a.metric
    lines = ["## Blocks", "",
             "Every seed belongs to one block; the arms of a seed are paired, so every paired difference lies within "
             "a block and the pooled sign-flip test treats the blocks as fixed (block effects cancel in the "
             "differences). Below: each block's start, its level before training (mean over its runs of the "
             f"`{START_TAG_PREFIX}...` scalars) and the mean paired difference of each arm within it.", ""]
    others = [v.name for v in study.variants if v.name != study.control]
    head = ["block", "seeds", "loads (sha256, first 16 hex)", "before training"] + [f"{n} - {study.control}"
                                                                                   for n in others]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ctrl = a.summaries[study.control].values
    for block in study.blocks.values():
        _, ckpts = referenced_files(overrides_to_args(block.overrides))
        loads = "; ".join(f"`{name}` {file_digest(path)[:16] if path else 'missing'}" for name, path in ckpts.items())
        starts: dict[str, list[float]] = {}
        for r in results:
            if r.ok and r.spec.seed in block.seeds:
                for tag, value in r.final.items():
                    if tag.startswith(START_TAG_PREFIX):
                        starts.setdefault(tag, []).append(value)
        before = "; ".join(f"{tag.removeprefix(START_TAG_PREFIX)} {statistics.mean(v) * m.scale:.1f}"
                           for tag, v in sorted(starts.items()) if "greedy_pass" in tag and tag.count("/") <= 2)
        row = [block.name, ", ".join(map(str, block.seeds)), loads or "-", before or "n/a"]
        for name in others:
            vals = a.summaries[name].values
            diffs = [vals[s] - ctrl[s] for s in block.seeds if s in vals and s in ctrl]
            row.append(f"{_fmt(statistics.mean(diffs), m, sign=True)} (n={len(diffs)})" if diffs else "n/a")
        lines.append("| " + " | ".join(row) + " |")
    return lines + [""]


def quick_mode_note(reproduce: str) -> list[str]:
    """A line for a report whose runs were changed with `--set` (a quick mode): the study file's description, budget
    and plan describe the study as shipped, not these runs."""
    import shlex

    parts = shlex.split(reproduce)
    settings = [parts[i + 1] for i, part in enumerate(parts[:-1]) if part == "--set"]
    if not settings:
        return []
    return [f"> **Not the study as shipped:** these runs were changed with {', '.join(f'`{s}`' for s in settings)}. "
            "The description, budget and power plan below are the study file's and describe its own settings, not "
            "these runs; the setup lists what the runs used.", ""]


def write_report(study: Study, analyses: Sequence[MetricAnalysis], results: Sequence[RunResult],
                 charts: Sequence[Path], out_dir: Path, reproduce: str, n_boot: int, elapsed_s: float | None = None,
                 workers: int | None = None) -> Path:
    """`<out_dir>/REPORT.md`. `n_boot` is kept for the CLI's signature; the report no longer bootstraps."""
    del n_boot
    primary = analyses[0]
    ok = [r for r in results if r.ok]
    failed = [r for r in results if r.status == "failed"]
    cancelled = [r for r in results if r.status == "cancelled"]
    lines = [f"# Study `{study.name}`", "", *quick_mode_note(reproduce)]
    if study.description:
        lines += [study.description, ""]
    lines += [f"**Primary metric `{primary.metric.tag}`, {len(study.seeds)} seeds per variant:**", ""]
    for c in primary.comparisons:
        lines.append(f"- {c.verdict}")
    if not primary.comparisons:
        lines.append("- no comparison could be made")
    lines += [""] + power_lines(study, primary)

    lines += ["## Setup", "",
              f"- study file: `{_rel(study.path)}`; base config: `{_rel(study.base)}`",
              "- common overrides: " + (" ".join(f"`{a}`" for a in overrides_to_args(study.overrides)) or "none"),
              f"- variable: `{study.variable or '(see variants)'}`; control: **{study.control}**",
              "- variants: " + "; ".join(f"**{v.name}** = " + " ".join(f"`{a}`" for a in overrides_to_args(v.overrides))
                                         for v in study.variants),
              f"- seeds: {study.seeds} (each passed as " + ", ".join(f"`{k}`" for k in study.seed_keys) + ")",
              f"- runs: {len(ok)} finished ({sum(r.status == 'done' for r in results)} in this invocation, "
              f"{sum(r.status == 'skipped' for r in results)} reused), {len(failed)} failed, {len(cancelled)} not run",
              ]
    walls = [r.wall_s for r in ok if r.wall_s]
    if walls:
        took = f"; this invocation took {elapsed_s / 60:.1f} min" if elapsed_s else ""
        lines.append(f"- wall time per run: median across the {len(walls)} finished runs "
                     f"{statistics.median(walls):.0f} s (min {min(walls):.0f}, max {max(walls):.0f}){took}"
                     + (f" with {workers} workers" if workers else ""))
    if study.budget:
        lines.append(f"- budget: {study.budget}")
    if study.power_note:
        lines.append(f"- {study.power_note}")
    lines += [f"- code: {runs_code(ok)}; package source digest `{source_digest()}`; report written "
              f"{time.strftime('%Y-%m-%d %H:%M')} at git {git_revision()}", ""]
    if study.blocks:
        lines += block_section(study, primary, results)

    for i, a in enumerate(analyses):
        lines += metric_section(study, a, primary=i == 0)

    if charts:
        lines += ["## Charts", ""]
        lines += [f"![{p.stem}]({p.name})" for p in charts]
        lines.append("")

    if study.tutorial:
        lines += ["## The tutorial's result for comparison", "", study.tutorial, ""]

    lines += [f"## Per-seed values of `{primary.metric.tag}`", ""] + _per_seed_table(study, primary)

    n_pairs = max((c.n for c in primary.comparisons), default=0)
    lines += ["## Method", "",
              ("- Final value = the last logged value of each TensorBoard scalar tag in each run." if study.score_at is None
               else f"- Scored value = each run's {study.score_at.describe()}: point {study.score_at.evaluation} of "
                    f"its evaluation curve, not its last logged value. Why: {study.score_at.reason}"),
              "- Per variant: mean across seeds with a Student-t 95% interval; for rates (accuracies, pass rates) "
              "the interval and the chart bands are clipped to the metric's range [0, 1] (x scale).",
              "- Paired comparison against the control on matched seeds: per-seed difference d = variant - control "
              "and its mean (a median, where shown, is the median of these paired differences). Two-sided exact "
              f"sign-flip permutation test (all 2^n sign patterns when n <= {EXACT_SIGN_FLIP_MAX_N}; with n = "
              f"{n_pairs} the smallest attainable p is {format_p(min_attainable_p(n_pairs))}).",
              "- The 95% CI of the mean difference inverts that test (the shifts t that the test of d - t does not "
              "reject: Hartigan's subset-mean interval), so it excludes 0 exactly when p < 0.05; with 5 or fewer "
              "seeds no shift is ever rejected and only the exact test is shown. (A bootstrap interval can exclude 0 "
              "at 2 seeds while the exact test gives p = 0.5; this one cannot.) The interval is per comparison: it "
              "agrees with the unadjusted p, not with Holm's.",
              "- Holm's step-down adjustment across the comparisons of each metric; a verdict calls a difference "
              "only when the (Holm-adjusted, if more than one comparison) p is below 0.05. Secondary metrics are "
              "exploratory.",
              f"- Minimum detectable effect (MDE): the smallest true mean difference the test detects with "
              f"{POWER:.0%} probability at this n, at alpha = 0.05 / (number of comparisons) (Holm's first step), "
              "for normal differences with the observed SD: exact for 6 seeds (the test then rejects only when all "
              "differences share a sign), the paired-t power otherwise (the exact test's power is about 0.75-0.80 "
              "there at 7-16 seeds, so the MDE is slightly optimistic at 7-10 seeds). A null verdict reads "
              "\"an effect of ±MDE would be detected 80% of the time\" (which effects the data exclude comes from "
              "the CI), or \"underpowered\" when n is too small for p < 0.05 to be possible. "
              "The SD is estimated from the same runs, so the MDE is itself approximate.",
              ""]

    if failed or cancelled:
        lines += ["## Failed runs", ""]
        for r in failed:
            lines += [f"- `{r.spec.key}` (exit {r.returncode}, `{_rel(r.spec.run_dir)}/stderr.log`):", "",
                      "```", r.error.strip()[-3000:], "```", ""]
        for r in cancelled:
            lines.append(f"- `{r.spec.key}`: not run")
        lines.append("")

    example = next((r for r in results), None)
    lines += ["## Reproduce", "", "```", reproduce, "```", ""]
    if example is not None:
        lines += ["One run by hand (logs into the current directory's lightning_logs/):", "", "```",
                  "python -m glm_lightning fit " + " ".join(_rel_arg(a) for a in example.spec.args
                                                            if not a.startswith(("--trainer.logger.init_args",
                                                                                 "--trainer.default_root_dir"))),
                  "```", ""]
    lines += [f"TensorBoard: `tensorboard --logdir {_rel(out_dir)}` (runs) or "
              f"`tensorboard --logdir {_rel(out_dir / 'hparams')}` (HPARAMS tab: one row per run).", ""]
    path = out_dir / "REPORT.md"
    path.write_text("\n".join(lines))
    return path


def _rel(path: Path) -> str:
    path = Path(path).resolve()
    for root in (Path.cwd(), REPO_ROOT):
        try:
            return str(path.relative_to(root))
        except ValueError:
            continue
    return str(path)


def _rel_arg(arg: str) -> str:
    return _rel(Path(arg)) if arg.startswith("/") and Path(arg).exists() else (
        "'" + arg + "'" if any(ch in arg for ch in " {}[]\"") else arg)
