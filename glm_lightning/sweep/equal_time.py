"""Equal wall-clock time from the runs themselves, with a band for step-time noise (issue 47).

Why: the ablations' equal-time twins got their step counts from step times measured once, on one machine. The demo
hybrid's dev pass rises ~0.9 points per step near step 150, one machine timed the same model 11% apart in two
sittings (~15 steps, 10+ points), and the equal-time verdict against dense attention flipped between two CPUs. Here
each run's seconds per step come from its own recorded wall time (`wall_s` / steps: startup and its evaluations
included, so a rough figure), the two arms of a seed are compared at the minutes of the shorter one (the other's
value read off its own evaluation curve by linear interpolation between evaluations), and the comparison is repeated
with the arm's step time scaled by 0.9 and 1.1: a verdict that changes inside that band is reported as such.

    python -m glm_lightning.sweep.equal_time ablation_mixer ablation_mhc ...   # markdown to stdout
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from glm_lightning.stats import format_p, holm, sign_flip_ci, sign_flip_permutation_test
from glm_lightning.sweep.study import REPO_ROOT, load_study

BAND = (0.9, 1.0, 1.1)
"""Factors on the arm's seconds per step: the ±10% step-time noise band."""
MIN_SEEDS = 6
"""Fewer overlapping seeds cannot give p < 0.05 with the exact test: such a cell is not a verdict."""
DATA = REPO_ROOT / "docs" / "results" / "data"
EXPERIMENTS = REPO_ROOT / "configs" / "experiments"


def value_at(curve: Sequence[Sequence[float]], step: float) -> float | None:
    """The curve's value at `step` by linear interpolation between evaluations (None outside its first..last)."""
    pts = sorted((float(s), float(v)) for s, v in curve)
    if not pts or step < pts[0][0] - 1e-9 or step > pts[-1][0] + 1e-9:
        return None
    for (s0, v0), (s1, v1) in zip(pts, pts[1:]):
        if s0 <= step <= s1:
            return v0 + (v1 - v0) * (step - s0) / (s1 - s0) if s1 > s0 else v1
    return pts[-1][1]


def paired_at_equal_time(control: dict, arm: dict, tag: str, factor: float = 1.0) -> tuple[float, float, float] | None:
    """(control value, arm value, minutes) of one seed at the minutes of the shorter run, the arm's seconds per step
    scaled by `factor`; None when a run's curve does not reach back to that time."""
    cc, ca = control["curves"].get(tag), arm["curves"].get(tag)
    if not cc or not ca:
        return None
    steps_c, steps_a = cc[-1][0] + 1, ca[-1][0] + 1
    sps_c, sps_a = control["wall_s"] / steps_c, factor * arm["wall_s"] / steps_a
    t = min(steps_c * sps_c, steps_a * sps_a)
    vc, va = value_at(cc, t / sps_c - 1), value_at(ca, t / sps_a - 1)
    return None if vc is None or va is None else (vc, va, t / 60)


@dataclass
class EqualTime:
    arm: str
    factor: float
    n: int
    mean: float
    lo: float
    hi: float
    p: float
    p_holm: float = math.nan
    minutes: float = math.nan

    @property
    def word(self) -> str:
        if self.n == 0 or math.isnan(self.p_holm):
            return "n/a"
        if self.n < MIN_SEEDS:
            return f"too few seeds overlap (n={self.n})"
        return ("arm better" if self.mean > 0 else "arm worse") if self.p_holm < 0.05 else "no significant difference"


def study_equal_time(name: str, tag: str = "val/dev_pass", scale: float = 100.0) -> list[list[EqualTime]]:
    """Per arm of the study (every variant but the control), its comparison at each band factor, Holm across the arms
    at each factor."""
    study = load_study(EXPERIMENTS / f"{name}.yaml")
    runs = json.loads((DATA / f"{name}.json").read_text())["runs"]
    by = {(r["variant"], r["seed"]): r for r in runs if r.get("curves") and r.get("wall_s")}
    arms = [v.name for v in study.variants if v.name != study.control]
    table: list[list[EqualTime]] = []
    for arm in arms:
        row = []
        for f in BAND:
            pairs = [paired_at_equal_time(by[(study.control, s)], by[(arm, s)], tag, f) for s in study.seeds
                     if (study.control, s) in by and (arm, s) in by]
            pairs = [p for p in pairs if p is not None]
            d = np.array([(a - c) * scale for c, a, _ in pairs])
            if d.size == 0:
                row.append(EqualTime(arm, f, 0, math.nan, math.nan, math.nan, math.nan))
                continue
            lo, hi = sign_flip_ci(d) if d.size > 5 else (math.nan, math.nan)
            row.append(EqualTime(arm, f, int(d.size), float(d.mean()), lo, hi, sign_flip_permutation_test(d),
                                 minutes=float(np.mean([m for _, _, m in pairs]))))
        table.append(row)
    for k in range(len(BAND)):
        tested = [row[k] for row in table if row[k].n]
        for r, p in zip(tested, holm([r.p for r in tested])):
            r.p_holm = p
    return table


def render(name: str, table: list[list[EqualTime]]) -> list[str]:
    lines = [f"### {name}", "", "| arm - control | " + " | ".join(f"arm step time x{f:g}" for f in BAND)
             + " | inside the ±10% band |", "|---|" + "---|" * (len(BAND) + 1)]
    for row in table:
        cells = []
        for r in row:
            if r.n == 0:
                cells.append("no overlap of the curves")
                continue
            ci = f" [{r.lo:+.1f}, {r.hi:+.1f}]" if math.isfinite(r.lo) else ""
            cells.append(f"{r.mean:+.1f}{ci}, Holm p={format_p(r.p_holm)}, n={r.n}, at {r.minutes:.1f} min: {r.word}")
        words = {r.word for r in row if r.n >= MIN_SEEDS}
        flips = "verdict flips inside the band" if len(words) > 1 else "stable" if words else "n/a"
        lines.append(f"| {row[0].arm} | " + " | ".join(cells) + f" | {flips} |")
    return lines + [""]


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m glm_lightning.sweep.equal_time", description=__doc__.split("\n\n")[0])
    p.add_argument("studies", nargs="+")
    p.add_argument("--tag", default="val/dev_pass")
    args = p.parse_args(argv)
    for name in args.studies:
        print("\n".join(render(name, study_equal_time(name, args.tag))))


if __name__ == "__main__":
    main()
