"""The power plan a sweep prints before it runs (issue 47): for every "no difference" claim, the seeds its margin
needs for the equivalence test to succeed 80% of the time if the true difference is 0, from the SD of paired
differences in a pilot or an earlier study's committed runs; and the refusal to run a study whose equivalence claims
the plan shows it cannot reach, unless `--allow-underpowered` (the report then names the override).

Why: with 10 seeds and paired SDs of 6.9-12.1 points, the ablations' equivalence at ±5 needed 17-51 seeds, so every
near-null ablation was bound to read "inconclusive"; the plan says so before any compute is spent.

The SD comes from `power_plan: {sd_from: <study>, reason: ...}` in the study file (a study whose committed data,
docs/results/data/<study>.json, has the same variant names), else from the study's own committed data (an earlier
run). Each claim uses its own variant's SD, or, for a variant the source lacks, the largest SD there. alpha is
Holm's first step over the study's null claims on the metric (alpha / k), the bar a claim must clear when all are
equivalent. More evaluation tasks shrink the part of the SD that comes from sampling tasks. When the study states how many
tasks a run's metric averages over (`power_plan: {eval_tasks: N}`, a pass rate), the plan bounds what 2x and 4x the
tasks would buy: a difference of two pass rates measured on n tasks drawn per seed varies across task draws by at most
(p_c (1 - p_c) + p_v (1 - p_v)) / n (binomial; equal when the two arms' outcomes on a task are independent, less when,
as on shared tasks, they agree more often), so the part between seeds is at least the rest. With m tasks the SD is then
between sqrt(max(SD^2 n / m, SD^2 - V / n (1 - n / m))) and today's SD, and the seeds needed between the two counts
those give. The plan prints that range; a pilot at the new task count pins it down.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from glm_lightning.power import POWER, tost_power, tost_seeds
from glm_lightning.sweep.score_at import point
from glm_lightning.sweep.study import REPO_ROOT, Study, StudyError

DATA_DIR = REPO_ROOT / "docs" / "results" / "data"


@dataclass
class ClaimPlan:
    variant: str
    claim: str
    margin: float
    sd: float
    n_source: int
    source: str
    alpha: float
    planned: int
    needed: int | None
    power: float
    unit: str = ""
    tasks: str = ""
    """With `power_plan.eval_tasks`: the seeds needed with 2x and 4x the evaluation tasks (a range, see above)."""

    @property
    def reachable(self) -> bool:
        return self.needed is not None and self.planned >= self.needed

    def line(self) -> str:
        need = f"{self.needed}" if self.needed is not None else "more than 1000"
        return (f"{self.variant} vs control: margin ±{self.margin:g}{' ' + self.unit if self.unit else ''}, SD of "
                f"paired differences {self.sd:.3g} ({self.source}, n={self.n_source}); equivalence at alpha {self.alpha:.3g} needs "
                f"{need} seeds for {POWER:.0%} power if the true difference is 0; planned {self.planned}: power "
                f"{self.power:.2f}" + ("" if self.reachable else " -- CANNOT REACH") + self.tasks)


def _scored_evaluation(study: Study, source: str) -> int | None:
    """The evaluation the source study scores (its `score_at`), so the SD is of the values its rows compare."""
    if source == study.name:
        return study.score_at.evaluation if study.score_at is not None else None
    path = REPO_ROOT / "configs" / "experiments" / f"{source}.yaml"
    if not path.is_file():
        return None
    from glm_lightning.sweep.study import load_study

    other = load_study(path)
    return other.score_at.evaluation if other.score_at is not None else None


def _source_values(study: Study, source: str, tag: str, scale: float) -> dict[str, dict[int, float]]:
    data = json.loads((DATA_DIR / f"{source}.json").read_text())
    out: dict[str, dict[int, float]] = {}
    k = _scored_evaluation(study, source)
    for run in data.get("runs", []):
        value = point((run.get("curves") or {}).get(tag), k) if k is not None else (run.get("final") or {}).get(tag)
        if value is not None and math.isfinite(value):
            out.setdefault(str(run["variant"]), {})[int(run["seed"])] = value * scale
    return out


def task_bounds(margin: float, sd: float, alpha: float, n_tasks: int, means: tuple[float, float], scale: float,
                factors: tuple[int, ...] = (2, 4)) -> str:
    """'; with 2x tasks (320): 9-14 seeds, ...': the seeds the margin needs with more evaluation tasks, from the
    binomial bound on the task-sampling part of the paired SD (module docstring). `means` are the two arms' mean
    pass rates (fractions), `sd` and `margin` in the metric's scaled unit."""
    v_task = sum(p * (1 - p) for p in means) * scale ** 2 / n_tasks  # at most this much of sd^2 is task sampling
    high = tost_seeds(margin, sd, alpha)  # more tasks never add variance: today's need is the upper end
    out = []
    for f in factors:
        low_var = max(sd ** 2 / f, sd ** 2 - v_task * (1 - 1 / f))
        low = tost_seeds(margin, math.sqrt(low_var), alpha) if low_var > 0 else 2
        rng = "more than 1000" if low is None else f"{low}" if low == high else f"{low}-{high or '>1000'}"
        out.append(f"{f}x tasks ({f * n_tasks}): {rng} seeds")
    bound = math.sqrt(v_task)
    why = (f"the binomial bound on task sampling, {bound:.3g}, is not below the SD: the data cannot say how much of it "
           f"more tasks remove" if bound >= sd else f"task sampling is at most {bound:.3g} of the SD's {sd:.3g}")
    return f"; with {', '.join(out)} ({why}; a pilot at the new task count pins it down)"


def _means(study: Study, values: dict[str, dict[int, float]], variant: str, scale: float) -> tuple[float, float] | None:
    """The control's and the variant's mean pass rates (fractions) in the source's values."""
    arms = [values.get(study.control), values.get(variant)]
    if not all(arms):
        return None
    return tuple(float(np.mean(list(a.values()))) / scale for a in arms)  # type: ignore[return-value]


def paired_sds(study: Study, values: dict[str, dict[int, float]]) -> dict[str, tuple[float, int]]:
    """SD (ddof 1) and n of the paired differences variant - control per variant in a source's values."""
    control = values.get(study.control, {})
    out = {}
    for name, vals in values.items():
        seeds = sorted(set(vals) & set(control))
        if name != study.control and len(seeds) >= 3:
            out[name] = (float(np.std([vals[s] - control[s] for s in seeds], ddof=1)), len(seeds))
    return out


def plan_claims(study: Study) -> tuple[list[ClaimPlan], str]:
    """The plan of every null claim of the study, and a note when no SD is known (no pilot, no earlier study)."""
    raw: dict[str, Any] = study.raw.get("power_plan") or {}
    source = str(raw.get("sd_from") or study.name)
    nulls = [c for c in study.claims if c.is_null and c.margin]
    if not nulls:
        return [], ""
    if not (DATA_DIR / f"{source}.json").is_file():
        return [], (f"no power plan: no committed runs of {source} to take the SD of paired differences from; run a "
                    f"pilot (e.g. --seeds 3) and name it in power_plan.sd_from")
    plans = []
    for claim in nulls:
        tag = claim.metric or study.primary.tag
        metric = next(m for m in study.metrics if m.tag == tag)
        values = _source_values(study, source, tag, metric.scale)  # read once per claim, for the SD and the means
        sds = paired_sds(study, values)
        if not sds:
            return [], f"no power plan: {source}'s committed runs have no paired seeds on {tag}"
        family = [c for c in nulls if (c.metric or study.primary.tag) == tag]
        alpha = 0.05 / len(family)
        sd, n_src = sds.get(claim.variant, max(sds.values()))
        label = f"{source}'s committed runs" + ("" if claim.variant in sds else ", the largest SD there")
        needed = tost_seeds(float(claim.margin), sd, alpha) if sd > 0 else 2
        planned = len(study.seeds)
        power = tost_power(float(claim.margin), sd, planned, alpha) if sd > 0 and planned >= 2 else 0.0
        tasks = ""
        n_tasks = raw.get("eval_tasks")
        means = _means(study, values, claim.variant, metric.scale) if n_tasks else None
        if n_tasks and means is not None and sd > 0:
            tasks = task_bounds(float(claim.margin), sd, alpha, int(n_tasks), means, metric.scale)
        plans.append(ClaimPlan(claim.variant, claim.claim, float(claim.margin), sd, n_src, label, alpha, planned,
                               needed, power, metric.unit, tasks))
    return plans, ""


def power_plan(study: Study, allow_underpowered: bool, log=print) -> str:  # noqa: ANN001
    """Print the plan; raise StudyError when a null claim cannot reach equivalence at the planned seeds, unless
    `allow_underpowered`. Returns the sentence the report's Setup shows."""
    plans, note = plan_claims(study)
    if note:
        log(f"[plan] {note}")
        return note
    if not plans:
        return ""
    for p in plans:
        log(f"[plan] {p.line()}")
    short = [p for p in plans if not p.reachable]
    summary = "; ".join(p.line() for p in plans)
    if short and not allow_underpowered:
        names = ", ".join(f"{p.variant} (needs {p.needed or '>1000'})" for p in short)
        raise StudyError(f"{study.path}: the power plan shows {len(short)} equivalence claim(s) this study cannot "
                         f"reach with {len(study.seeds)} seeds: {names}; add seeds or evaluation tasks, widen a "
                         f"margin with a reason, or pass --allow-underpowered (the report names it)")
    if short:
        return (f"power plan (run with --allow-underpowered: {len(short)} equivalence claim(s) could not reach "
                f"equivalence at the planned seeds, so their 'inconclusive' was expected): {summary}")
    return f"power plan: {summary}"
