"""The one findings table: `python -m glm_lightning sweep findings` writes docs/results/README.md, one row per claim
of the tutorial (`claims:` in the study files), from the studies' saved results; a claim whose study has no run of
the shipped settings reads "not run".

Where the results come from, per study (only runs of the study as shipped count: its arguments and base config
text, the run's `identity`, so a quick `--set` run or a run of an older config never enters the table; which code
and checkpoints a run was made from is recorded with it, in its fingerprint's parts, and the sweep that wrote a
folder never mixes runs of different inputs unless told to, see `runner.stale_runs`):
1. the sweep's output `<runs>/<study>/<variant>/seed<k>/DONE.json` (`--runs`, default runs/sweeps), with the
   invocation's wall time from `<runs>/<study>/results.json`;
2. else the committed copy `docs/results/data/<study>.json`, which this command refreshes from 1 whenever 1 has
   results, so the table can be regenerated without the (git-ignored) runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from glm_lightning.stats import format_p, holm, min_attainable_p, tost_sign_flip
from glm_lightning.sweep.analysis import Comparison, MetricAnalysis, analyse, study_cpus
from glm_lightning.sweep.claims import Claim, Verdict, judge
from glm_lightning.sweep.equivalence import Equivalence
from glm_lightning.sweep.fingerprint import portable_path, source_digest
from glm_lightning.sweep.events import read_scalars
from glm_lightning.sweep.report import commit_in_repository, runs_commit
from glm_lightning.sweep.runner import RunResult, RunSpec, finished_result, plan_runs, read_done
from glm_lightning.sweep.study import REPO_ROOT, Study, StudyError, load_study

RESULTS_FILE = "results.json"
EXPERIMENTS = REPO_ROOT / "configs" / "experiments"
STUDIES = ("ordering", "diversity", "curriculum", "rl_reward", "rl_invalid_penalty", "rl_temperature",
           "rl_group_size", "rl_screen_tutorial", "ablation_mhc", "ablation_mhc_2streams", "ablation_mixer",
           "ablation_moe", "ablation_indexer", "ablation_moe_25m", "ablation_mixer_25m", "ablation_mixer_avx512", "bf16_parity", "bf16_parity_rl",
           "rl_screen_tutorial_t1")
"""The studies of the table, in its order (each must have `claims:`)."""
WORKERS = 2


# --- saved results ---------------------------------------------------------------------------------------------------
def results_payload(study: Study, results: Sequence[RunResult], command: str, elapsed_s: float | None,
                    workers: int | None, git: str = "") -> dict[str, Any]:
    """What a sweep saves next to its report: per finished run its fingerprint, the final value and the evaluation
    curve of every study metric and its wall time, plus how the invocation ran. Small enough to commit, and enough
    to redraw the curves once the (git-ignored) run folders are gone."""
    tags = [m.tag for m in study.metrics]
    runs = [{"variant": r.spec.variant, "seed": r.spec.seed, "fingerprint": r.spec.fingerprint, "git": r.git,
             "identity": r.spec.identity, "parts": r.spec.parts,
             "final": {t: r.final[t] for t in tags if t in r.final}, "wall_s": round(r.wall_s, 2),
             "curves": run_curves(r, tags)}
            for r in results if r.ok]
    return {"study": study.name, "written": time.strftime("%Y-%m-%d %H:%M"), "git": git, "command": command,
            "elapsed_s": None if elapsed_s is None else round(elapsed_s, 1), "workers": workers,
            "ran_now": sum(r.status == "done" for r in results), "runs": runs}


def run_curves(result: RunResult, tags: Sequence[str]) -> dict[str, list[list[float]]]:
    """`{tag: [[step, value], ...]}` of the run's evaluations: the ones it carries, else its folder's events."""
    curves = result.curves
    if not curves and result.spec.run_dir.is_dir():
        curves = read_scalars(result.spec.run_dir)
    return {t: [[int(step), float(v)] for step, v in curves[t]] for t in tags if curves.get(t)}


def write_results(path: Path, payload: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    return path


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


@dataclass
class StudyResults:
    """The finished runs of the shipped study found in one source."""

    study: Study
    results: list[RunResult] = field(default_factory=list)
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    stale: int = 0  # saved runs of other settings (ignored)
    rewritten: int = 0  # saved runs whose identity is the current config's but whose recorded config digest is not
    equivalent: dict[Equivalence, list[tuple[str, str]]] = field(default_factory=dict)
    """Runs counted through a checked equivalence record: (identity as run, identity now) per run."""

    @property
    def total(self) -> int:
        return len(self.study.variants) * len(self.study.seeds)

    @property
    def finished(self) -> int:
        return len(self.results)


def from_runs(study: Study, runs_root: Path) -> StudyResults:
    """Finished runs in the sweep's output directory whose settings are the shipped study's."""
    out = StudyResults(study, source=str(runs_root / study.name))
    for spec in plan_runs(study, runs_root):
        done = read_done(spec, accept_old=True)  # the study's runs, whatever code they ran at (recorded with them)
        if done is not None:
            out.results.append(finished_result(spec, done))
    meta = _read_json(runs_root / study.name / RESULTS_FILE)
    if meta is not None:
        out.meta = {k: v for k, v in meta.items() if k != "runs"}
    return out


def from_saved(study: Study, path: Path, runs_root: Path) -> StudyResults:
    """Runs recorded in a saved results file (e.g. docs/results/data/<study>.json) that match the shipped study."""
    out = StudyResults(study, source=str(path))
    data = _read_json(path)
    if data is None:
        return out
    planned = plan_runs(study, runs_root)
    specs: dict[tuple[str, int, str], RunSpec] = {(s.variant, s.seed, s.identity): s for s in planned}
    by_seed = {(s.variant, s.seed): s for s in planned}
    base = portable_path(study.base)
    checked = [(e, e.check_edit(REPO_ROOT)) for e in study.equivalences if e.config == base]
    for run in data.get("runs", []):
        # runs saved before fingerprints had parts carry their identity as their fingerprint
        recorded = run.get("identity") or run.get("fingerprint")
        spec = specs.get((run.get("variant"), run.get("seed"), recorded))
        planned_spec = by_seed.get((run.get("variant"), run.get("seed")))
        ran_with = (run.get("parts") or {}).get("configs", {}).get(base)
        if spec is not None and ran_with is not None and ran_with != spec.parts.get("configs", {}).get(base):
            out.rewritten += 1  # its identity says the current text, its own record another: never trusted
            out.stale += 1
            continue
        if spec is None and planned_spec is not None:
            variant = study.variant(planned_spec.variant)
            for record, old_text in checked:
                if record.covers(run, old_text, lambda text: study.identity(variant, planned_spec.seed, text)):
                    spec = planned_spec
                    out.equivalent.setdefault(record, []).append((str(recorded), planned_spec.identity))
                    break
        if spec is None:
            out.stale += 1
            continue
        spec = replace(spec, fingerprint=str(run.get("fingerprint")), parts=dict(run.get("parts") or {}))
        curves = {t: [(int(step), float(v)) for step, v in points] for t, points in (run.get("curves") or {}).items()}
        out.results.append(RunResult(spec, "skipped", dict(run.get("final", {})), {}, float(run.get("wall_s", 0)),
                                     git=str(run.get("git") or ""), curves=curves))
    out.meta = {k: v for k, v in data.items() if k != "runs"}
    return out


def collect(study: Study, runs_root: Path, data_dir: Path) -> StudyResults:
    """The study's results: the runs directory when it has at least as many finished runs of the shipped study as the
    saved copy, else the saved copy (a partial rerun never replaces a complete saved result: issue 35)."""
    live = from_runs(study, runs_root)
    saved = from_saved(study, data_dir / f"{study.name}.json", runs_root)
    if live.results and live.finished >= saved.finished:
        return live
    return saved


# --- one row per claim -----------------------------------------------------------------------------------------------
@dataclass
class Row:
    claim: Claim
    study: Study
    ours: str
    verdict: str
    command: str
    wall: str
    comparison: Comparison | None = None
    judged: Verdict | None = None
    provenance: str = ""
    """Runs counted through equivalence records (shown in the notes, once per study)."""


def _tutorial_cell(c: Claim) -> str:
    ci = f" [{c.ci[0]:+.1f}, {c.ci[1]:+.1f}]" if c.ci else ""
    text = f"{c.effect:+.1f}{ci}, p={format_p(c.p)}, n={c.n}"
    return f"{text}; {c.text}" if c.text else text


def _command(study: Study) -> str:
    """The command that runs the study as shipped (with the override its power plan needs, where it falls short)."""
    from glm_lightning.sweep.plan import plan_claims

    short = any(not p.reachable for p in plan_claims(study)[0])
    return (f"`python -m glm_lightning sweep --config {_rel(study.path)} --workers {WORKERS}"
            + (" --allow-underpowered`" if short else "`"))


def _wall(found: StudyResults) -> str:
    """The wall time the study took (or would take with 2 workers, from its run times)."""
    walls = [r.wall_s for r in found.results if r.wall_s > 0]
    meta = found.meta
    if meta.get("elapsed_s") and meta.get("ran_now") == found.total and found.finished == found.total:
        n = meta.get("workers")
        took = f"{meta['elapsed_s'] / 60:.0f} min with {n} worker{'' if n == 1 else 's'}"
    elif walls:
        took = f"≈{sum(walls) / WORKERS / 60:.0f} min with {WORKERS} workers (sum of run times / {WORKERS})"
    else:
        return "n/a"
    return took + (f"; median {statistics.median(walls):.0f} s per run" if walls else "")


def _expected(study: Study) -> str:
    return f"expected ≈{study.expected_minutes:g} min" if study.expected_minutes else "n/a"


def equivalence_p(study: Study, analysis: MetricAnalysis, claim: Claim) -> tuple[float, float]:
    """(raw, Holm-adjusted) p of the equivalence test (TOST at ±margin, `stats.tost_sign_flip`) of a null claim:
    the study's null claims on this metric form one Holm family, as its comparisons do for the difference test
    (every shipped study states one claim per comparison, so the two families have the same size)."""
    scale = analysis.metric.scale
    by_variant = {c.variant: c for c in analysis.comparisons}
    family = [c for c in study.claims if c.is_null and (c.metric or study.primary.tag) == analysis.metric.tag
              and by_variant[c.variant].n > 0]
    raw = [tost_sign_flip([d * scale for d in by_variant[c.variant].diffs], float(c.margin)) for c in family]
    if claim not in family:
        return math.nan, math.nan
    i = family.index(claim)
    return raw[i], holm(raw)[i]


def claim_row(claim: Claim, found: StudyResults) -> Row:
    """Our side of one claim: the paired comparison of the claim's variant with the control, judged."""
    study = found.study
    command = _command(study)
    if not found.results:
        why = "not run"
        if found.stale:
            why += f" (the {found.stale} saved runs are of other settings)"
        if found.rewritten:
            why += (f"; {found.rewritten} of them carry the current config's identity but recorded another config "
                    "text: a rewritten identity, refused")
        return Row(claim, study, why, "not run", command, _expected(study))
    analyses = analyse(study, found.results)
    analysis = next(a for a in analyses if a.metric.tag == (claim.metric or study.primary.tag))
    comp = next(c for c in analysis.comparisons if c.variant == claim.variant)
    partial = "" if found.finished == found.total else f"; partial: {found.finished}/{found.total} runs"
    if comp.n == 0:
        return Row(claim, study, f"no paired seeds yet{partial}", "not run", command, _wall(found), comp)
    scale = analysis.metric.scale
    several = len(analysis.comparisons) > 1
    p = comp.p_holm if several else comp.p
    diff, lo, hi, mde = comp.mean_diff * scale, comp.lo * scale, comp.hi * scale, comp.mde * scale
    d = claim.decimals
    ci = f"[{lo:+.{d}f}, {hi:+.{d}f}]" if math.isfinite(lo) and math.isfinite(hi) else "no CI (n ≤ 5: exact test only)"
    power = f"MDE ±{mde:.{d}f}" if math.isfinite(mde) else "no MDE (underpowered)" if math.isinf(mde) else "MDE n/a"
    holm_note = " (Holm)" if several else ""
    ours = f"{diff:+.{d}f} {ci}, p={format_p(p)}{holm_note}, n={comp.n} seeds, {power}"
    p_equiv = None
    if claim.is_null:
        p_raw, p_adj = equivalence_p(study, analysis, claim)
        p_equiv = p_adj if several else p_raw
        ours += f"; TOST ±{claim.margin:g}: p={format_p(p_equiv)}{holm_note}"
    verdict = judge(claim, diff, lo, hi, p, mde, p_equiv)
    word = verdict.word if not partial else f"{verdict.word} (so far)"
    ours += equal_time_note(study.name, claim.variant)
    return Row(claim, study, ours + partial + code_note(found), f"**{word}**: {verdict.why}", command, _wall(found),
               comp, verdict, provenance_note(found))


@functools.lru_cache(maxsize=None)
def _equal_time_table(name: str) -> dict[str, list[Any]]:
    from glm_lightning.sweep.equal_time import study_equal_time

    try:
        return {row[0].arm: row for row in study_equal_time(name)}
    except (OSError, KeyError, ValueError, StudyError):
        return {}


def equal_time_note(study: str, variant: str) -> str:
    """For an equal-time twin's row: the same question asked from the runs' own minutes with the step time ±10%
    (`sweep.equal_time`, docs/results/equal_time.md), and whether the verdict flips inside that band (issue 47)."""
    if not variant.endswith("_equal_time"):
        return ""
    row = _equal_time_table(study).get(variant)
    if not row:
        return ""
    from glm_lightning.sweep.equal_time import MIN_SEEDS

    words = [r.word if r.n else "no overlap" for r in row]
    known = {r.word for r in row if r.n >= MIN_SEEDS}
    state = "flips inside the band" if len(known) > 1 else "stable" if known else "not computable"
    return (f"; from the runs' own minutes, step time x0.9/x1/x1.1: {' / '.join(words)} ({state}; "
            f"[equal_time.md](equal_time.md))")


def code_note(found: StudyResults) -> str:
    """Says in the row when its runs were made at other code than the current source, and when some count through
    an equivalence record (issue 47: the table never reads runs whatever code they ran at without saying so)."""
    now = source_digest()
    sources = {str((r.spec.parts or {}).get("source") or "") for r in found.results}
    gits = sorted({r.git for r in found.results if r.git})
    note = ""
    if sources - {now}:
        note = f"; runs made at other code than now (git {', '.join(gits) or 'unrecorded'})"
    cpus = study_cpus(found.results)
    if cpus:
        note += f"; CPU {', '.join(cpus)}"
    else:
        stated = found.study.cpu
        note += f"; CPU not recorded per run{f' (the study states: {stated})' if stated else ''}"
    n_equiv = sum(len(v) for v in found.equivalent.values())
    if n_equiv:
        note += f"; {n_equiv} of them count through an equivalence record (notes)"
    return note


def provenance_note(found: StudyResults) -> str:
    return " ".join(record.describe(pairs[0][0], pairs[0][1], len(pairs)) + "."
                    for record, pairs in found.equivalent.items())


# --- the README ------------------------------------------------------------------------------------------------------
HEADER = """# Findings: which of the tutorial's claims hold here

Generated by `python -m glm_lightning sweep findings` from the studies' saved results (do not edit by hand). "The
tutorial" is the freeCodeCamp course "Build & Train a GLM-5.3-Flash Model From Scratch with Python" and its
repository (see the top-level README); its numbers are quoted from its reports.

Every row compares one variant with its study's control on matched seeds, in points (percentage points) of the
study's primary metric: held-out byte accuracy for the data studies, pass@1 on the rewarded families for the RL
studies (the tutorial's RL screen counted greedy dev tasks solved out of 20, one seed; its effects are converted to
points). Ours: mean paired difference, its 95% CI (the inversion of the exact sign-flip test), the exact sign-flip p
(Holm-adjusted across a study's comparisons when it has several), the number of paired seeds, and the minimum
detectable effect (MDE) at 80% power for that n. The RL studies start from the demo's pre-training checkpoint:
run `python -m glm_lightning demo --stages pretrain` once first.

**Verdict rule.**
- Claims of an effect (the tutorial's p < 0.05): **reproduced** when our difference has the tutorial's sign and
  p < 0.05; **refuted** when it has the opposite sign with p < 0.05, or when it is not significant and our 95% CI
  excludes the tutorial's effect; otherwise **inconclusive** ("underpowered" when an effect of the tutorial's size
  would be detected less than 80% of the time at our n, or no p < 0.05 is possible).
- Claims of no difference (the tutorial's p >= 0.05), with the margin stated per row (the smallest difference that
  would matter): equivalence is judged by two one-sided sign-flip tests at ± the margin (TOST), Holm-adjusted
  across the study's comparisons exactly as the difference tests are. **reproduced** when equivalent (TOST
  p < 0.05) and the difference is not significant; **equivalent (a small difference)** when equivalent and
  significant: a real difference, inside the margin; **refuted** when significant with the whole 95% CI beyond
  the margin; **different (possibly inside the margin)** when significant, not shown equivalent and the CI reaches
  inside the margin (real, but not shown to matter); otherwise **inconclusive** ("underpowered" when an effect of the margin's size would be detected less than 80% of
  the time).
- The MDE says only what power says: an effect of ±MDE would be detected 80% of the time. Which effects our data
  exclude comes from the 95% CI, not from the MDE.
- A study without finished runs of its shipped settings shows **not run**; a partly finished one says so.

**Regimes.** Every RL row names the regime it was measured in. *Near-ceiling* (rows of rl_reward,
rl_invalid_penalty, rl_temperature, rl_group_size): the 1.3M-parameter demo model from its pre-training checkpoint
(pass@1 86-92% before RL), rollouts at T 0.7, lr 2e-4, last block + final norm + an untied head trained, 40 new
tokens, 288 training completions per run (36 prompts x G 8), 3 rewarded families (absolute, double, list_sum). The
tutorial's screen: its 25.7M model from an under-trained checkpoint (about 25% greedy dev pass), T 0.35, lr 5e-5,
last block + tied head, 32 new tokens, 128 training completions per arm, 5 families (increment, double, square,
even, reverse). A near-ceiling model compresses every effect, so these rows do not test the tutorial's regime. The
rows of rl_screen_tutorial re-run the screen in the tutorial's regime (`configs/experiments/rl_screen_tutorial.yaml`:
flash-25m from 3 under-trained pre-training checkpoints near 25% greedy pass, 6 RL seeds each, arms paired within a
seed and so within its checkpoint, the checkpoints as blocks), scored at each run's evaluation after exactly 128
training completions (`score_at`); differences from the tutorial's screen remain, listed in
[rl_screen_tutorial](rl_screen_tutorial.md) (the trained objective's temperature, the start's level, model size
26.5M vs 25.7M, prompt reuse, the evaluation set). The rows of rl_screen_tutorial_t1 run the temperature arms again
under the tutorial's objective (log-probs trained at T 1) with a 128-completion budget, on starts pre-trained again
on another CPU kind (an Intel Xeon): the same regime, other start checkpoints.
"""


OWN_HEADER = """## The lab's own questions

Questions no published result answers (which of our own parts and settings earn their keep), asked the same way: a
paired comparison with the study's control, judged by the rule for "no difference" at the margin stated per row
(**equivalent**, **equivalent (a small difference)**, **different (beyond the margin)**, **different (possibly
inside the margin)**, **inconclusive**). The row numbers continue the
table above, and its notes and code commits cover these rows too."""


ARCHITECTURE_PREFIX = "ablation_"
"""Studies named ablation_* ask what a part of the architecture buys: the "Architecture" section of the own questions."""


def own_sections(own: Sequence[tuple[int, Row]]) -> list[tuple[str, list[tuple[int, Row]]]]:
    """The own questions by kind: the architecture ablations (what each part buys, docs/results/ablations.md), then
    the rest (numerics and settings, e.g. bf16 parity); empty sections are left out."""
    arch = [(i, r) for i, r in own if r.study.name.startswith(ARCHITECTURE_PREFIX)]
    rest = [(i, r) for i, r in own if not r.study.name.startswith(ARCHITECTURE_PREFIX)]
    return [(title, rows) for title, rows in (
        ("Architecture: what each part buys ([ablations](ablations.md))", arch),
        ("Numerics and settings", rest)) if rows]


def table_wide_note(rows: Sequence[Row]) -> str:
    """Error control across the whole table (issue 47): each row's p is adjusted only within its study, so with this
    many rows some "different" verdicts are expected by chance; Holm over every row's unadjusted difference-test p
    says which survive, and the exact test's smallest p at each row's seeds says which rows never could."""
    tested = [(i, r.comparison) for i, r in enumerate(rows, 1)
              if r.comparison is not None and r.comparison.n > 0 and math.isfinite(r.comparison.p)]
    if not tested:
        return ""
    m = len(tested)
    adjusted = holm([c.p for _, c in tested])
    survive = [str(i) for (i, _), p in zip(tested, adjusted) if p < 0.05]
    never = sum(1 for _, c in tested if min_attainable_p(c.n) >= 0.05 / m)
    return (f"**Error control across the table.** Each row's p is Holm-adjusted within its study only. Over all {m} "
            f"rows with a result, Holm's first step needs p < 0.05/{m} = {0.05 / m:.1e}; the exact sign-flip test "
            f"cannot go below 2/2^n (at 10 seeds 2/1024 = 2.0e-03), so {never} of the {m} rows could never "
            f"pass it, and no table-wide error control is possible at these seed counts. Rows whose difference "
            f"survives Holm over the whole table: {', '.join(survive) if survive else 'none'}; every other "
            f"'different', 'refuted' or 'reproduced (an effect)' verdict holds per study, not table-wide.")


def _table_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"


def render(rows: Sequence[Row], generated: str, found_meta: dict[str, dict[str, Any]] | None = None) -> str:
    found_meta = found_meta or {}
    lines = [HEADER, "| # | claim | tutorial (effect, p) | ours (effect, 95% CI, p, n) | verdict | command | wall time |",
             "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        if r.claim.own:
            continue
        claim = r.claim.claim + (f" *(regime: {r.study.regime})*" if r.study.regime else "")
        lines.append(_table_row([str(i), claim, _tutorial_cell(r.claim), r.ours, r.verdict, r.command, r.wall]))
    own = [(i, r) for i, r in enumerate(rows, 1) if r.claim.own]
    if own:
        lines += ["", OWN_HEADER]
        for title, rows_in in own_sections(own):
            lines += ["", f"### {title}", "", "| # | question | ours (effect, 95% CI, p, n) | verdict | command | wall time |",
                      "|---|---|---|---|---|---|"]
            lines += [_table_row([str(i), r.claim.claim, r.ours, r.verdict, r.command, r.wall]) for i, r in rows_in]
    lines += ["", table_wide_note(rows)]
    notes = [(i, r) for i, r in enumerate(rows, 1) if r.claim.measure or r.claim.earlier or r.claim.margin]
    shown: set[str] = set()
    if notes:
        lines += ["", "## Notes per row", ""]
        for i, r in notes:
            parts = []
            if r.claim.measure:
                parts.append(r.claim.measure)
            if r.claim.margin:
                unit = next((m.unit for m in r.study.metrics if m.tag == (r.claim.metric or r.study.primary.tag)), "")
                parts.append(f"margin for \"no difference\": ±{r.claim.margin:g}{' ' + unit if unit else ''}"
                             + (f" ({r.claim.margin_reason})" if r.claim.margin_reason else ""))
            if r.claim.earlier:
                parts.append(f"earlier, smaller run: {r.claim.earlier}")
            if r.provenance and r.study.name not in shown:
                shown.add(r.study.name)
                parts.append(r.provenance.rstrip("."))
            lines.append(f"{i}. {'; '.join(parts)}.")
    code = []
    for name in dict.fromkeys(r.study.name for r in rows if r.comparison is not None):
        rev = str(found_meta.get(name, {}).get("git") or "unknown")
        known = commit_in_repository(rev)
        code.append(f"{name} `{rev}`" + ("" if known or known is None else
                                         f" (**not in this repository**: see [{name}]({name}.md))"))
    if code:
        lines += ["", "Code each study's runs ran at (the commit its sweep recorded): " + ", ".join(code) + "."]
    lines += ["", "Per-study reports (the latest committed run of each study, whatever its size: see its Setup section; "
              "per-seed values, secondary metrics, charts): "
              + ", ".join(f"[{s}]({s}.md)" for s in dict.fromkeys(r.study.name for r in rows)) + ".",
              "", f"_Generated {generated}._", ""]
    return "\n".join(lines)


def build_rows(studies: Sequence[Study], runs_root: Path, data_dir: Path,
               save: bool = True) -> tuple[list[Row], list[StudyResults]]:
    """The table's rows; with `save`, refreshes data_dir/<study>.json from the runs directory when it has runs."""
    rows, found_all = [], []
    for study in studies:
        found = collect(study, runs_root, data_dir)
        found_all.append(found)
        if save and found.results and found.source == str(runs_root / study.name):
            payload = results_payload(study, found.results, found.meta.get("command", ""),
                                      found.meta.get("elapsed_s"), found.meta.get("workers"),
                                      runs_commit(found.results) or found.meta.get("git", ""))
            payload["ran_now"] = found.meta.get("ran_now", 0)
            write_results(data_dir / f"{study.name}.json", payload)
        rows += [claim_row(c, found) for c in study.claims]
    return rows, found_all


def _rel(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def main(argv: Sequence[str] | None = None, log=print) -> Path:  # noqa: ANN001
    p = argparse.ArgumentParser(prog="python -m glm_lightning sweep findings",
                                description="Write the findings table (docs/results/README.md) from saved results.")
    p.add_argument("--runs", default="runs/sweeps", help="the sweeps' output root (default runs/sweeps)")
    p.add_argument("--data", default=str(REPO_ROOT / "docs" / "results" / "data"),
                   help="committed per-study results (read when a study has no runs; refreshed from the runs)")
    p.add_argument("--out", default=str(REPO_ROOT / "docs" / "results" / "README.md"))
    p.add_argument("--studies", nargs="*", default=None,
                   help="study files (default: " + ", ".join(f"{s}.yaml" for s in STUDIES) + ")")
    args = p.parse_args(list(argv) if argv is not None else None)
    paths = [Path(s) for s in args.studies] if args.studies else [EXPERIMENTS / f"{s}.yaml" for s in STUDIES]
    studies = [load_study(path) for path in paths]
    for study in studies:
        if not study.claims:
            raise StudyError(f"{study.path}: no `claims:` to put in the findings table")
    rows, found = build_rows(studies, Path(args.runs).resolve(), Path(args.data))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    changed = write_unless_only_the_date_changed(out, render(rows, time.strftime("%Y-%m-%d %H:%M"),
                                                             {f.study.name: f.meta for f in found}))
    for f in found:
        log(f"[findings] {f.study.name}: {f.finished}/{f.total} runs of the shipped settings"
            + (f" from {_rel(Path(f.source))}" if f.results else "") + (f", {f.stale} stale" if f.stale else ""))
    log(f"[findings] wrote {out}" if changed else f"[findings] {out} unchanged (only its date would change)")
    return out


GENERATED_LINE = re.compile(r"^_Generated [^\n]*_\.?$", re.MULTILINE)


def write_unless_only_the_date_changed(out: Path, text: str) -> bool:
    """Write the table unless the file already holds it with another `_Generated ..._` date (a tracked file is not
    rewritten for a timestamp alone); returns whether it wrote."""
    if out.is_file() and GENERATED_LINE.sub("", out.read_text()) == GENERATED_LINE.sub("", text):
        return False
    out.write_text(text)
    return True
