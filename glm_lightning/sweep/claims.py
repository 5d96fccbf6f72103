"""The tutorial's claims a study tests, and the rule that turns our paired comparison into a verdict.

A study file lists them under `claims:` (see docs/sweeps.md), each comparing one variant with the study's control
on the primary metric (or `metric:`), in the metric's display units (value x scale, e.g. points):

    claims:
      - claim: interleaved beats blocked (same examples, same steps)
        variant: interleaved
        tutorial: {effect: 9.7, ci: [7.6, 11.7], p: 0.00195, n: 10 paired seeds}
      - claim: a curriculum 8 -> 88 structures gives no gain over diverse data
        variant: curriculum
        tutorial: {effect: -0.6, ci: [-1.4, 0.3], p: 0.2148, n: 10 paired seeds}
        margin: 2.0            # null claims only: the smallest difference that would matter

The verdict rule (`judge`), stated once so the findings table and its tests use the same words:

- **Effect claims** (the tutorial's p < 0.05): *reproduced* when our difference has the tutorial's sign and our p
  < 0.05 (noting when our 95% CI excludes the tutorial's size, and how the settings differ where they do:
  `differs:`); *refuted* when it has the opposite sign with
  p < 0.05, or when it is not significant and our CI excludes the tutorial's effect (an effect that large is ruled
  out); otherwise *inconclusive*: "underpowered" when an effect of the tutorial's size would be detected less than
  80% of the time at our n (MDE infinite or larger than the tutorial's effect), else the CI says which effects
  remain possible.
- **Null claims** (the tutorial's p >= 0.05, "no difference"), judged by two tests: the difference test (p) and
  the equivalence test (two one-sided sign-flip tests at ±margin, TOST: `stats.tost_sign_flip`), both Holm-adjusted
  across the study's comparisons of the metric:
  * *reproduced*: equivalent (TOST p < 0.05) and no significant difference;
  * *equivalent (a small difference)*: equivalent and significant: a real difference, but inside ±margin;
  * *refuted*: a significant difference whose whole 95% CI lies beyond ±margin;
  * *different (possibly inside the margin)*: a significant difference whose CI reaches inside ±margin and is not
    shown equivalent: real, but neither shown to matter nor shown not to (issue 47);
  * *inconclusive*: neither ("underpowered" when an effect of the margin's size would be detected less than 80% of
    the time, else the CI reaches beyond ±margin).

**The lab's own questions** (architecture ablations, bf16 parity: no published result to test) are written as a claim
without `tutorial:`, with a `margin:` (the smallest difference that would matter); the question is "does the variant
differ from the control by more than ±margin?", judged by the null rule above with its words for our own question:
*equivalent* (for *reproduced*), *equivalent (a small difference)*, *different (beyond the margin)* (for *refuted*),
*different (possibly inside the margin)*, *inconclusive*:

      - claim: 1 residual stream learns as well as 4 (mHC)
        variant: streams1
        margin: 5.0

The MDE is only what power says: an effect of ±MDE would be detected 80% of the time; which effects the data
exclude comes from the CI. Our p is Holm-adjusted when the study makes several comparisons (as in its report); the CI
is the per-comparison interval that inverts the exact sign-flip test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm_lightning.stats import format_p

ALPHA = 0.05
CLAIM_KEYS = {"claim", "variant", "tutorial", "margin", "metric", "measure", "earlier", "differs", "margin_reason"}
TUTORIAL_KEYS = {"effect", "ci", "p", "n", "text"}


@dataclass(frozen=True)
class Claim:
    """One published result of the tutorial, as `variant - control` in the metric's display units."""

    claim: str
    variant: str
    effect: float
    p: float
    n: str
    ci: tuple[float, float] | None = None
    text: str = ""
    margin: float | None = None
    metric: str | None = None
    measure: str = ""
    earlier: str = ""
    differs: str = ""
    """How our setting differs from the tutorial's (empty: they match); a size comparison names it."""
    own: bool = False
    """The lab's own question (no tutorial result): "no difference beyond ±margin", judged by the null rule."""
    margin_reason: str = ""
    """Why the margin is this size (against the effect being studied) and when it was set (issue 47)."""

    @property
    def decimals(self) -> int:
        """Decimals to print this claim's numbers with: 1 for points, more for a metric whose margin is below 1
        (e.g. 3 for ±0.02 bits per byte)."""
        if self.margin is not None and 0 < self.margin < 1:
            return 1 - math.floor(math.log10(self.margin))
        return 1

    @property
    def is_null(self) -> bool:
        """The tutorial found no significant difference."""
        return self.p >= ALPHA


@dataclass(frozen=True)
class Verdict:
    word: str  # reproduced / refuted / equivalent (a small difference) / different (possibly inside the margin) /
    # inconclusive; own questions: equivalent, equivalent (a small difference), different (beyond the margin), ...
    why: str


def _number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be a number, got {value!r}")
    return float(value)


def parse_claims(path: Path, raw: Any, variants: list[str], control: str, tags: list[str]) -> list[Claim]:
    """The study's `claims:` entries, checked against its variants and metrics (ValueError names the entry)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ValueError(f"{path}: `claims` must be a list of {{claim, variant, tutorial}} entries")
    out = []
    for i, entry in enumerate(raw):
        where = f"{path}: claims[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be a mapping with claim, variant and tutorial")
        extra = set(entry) - CLAIM_KEYS
        own = "tutorial" not in entry
        missing = {"claim", "variant"} - set(entry) | ({"margin"} - set(entry) if own else set())
        if extra or missing:
            raise ValueError(f"{where}: unknown key(s) {sorted(extra)}, missing {sorted(missing)}; "
                             f"allowed: {sorted(CLAIM_KEYS)} (without `tutorial`, the lab's own question needs "
                             f"`margin`)")
        variant = str(entry["variant"])
        if variant not in variants or variant == control:
            raise ValueError(f"{where}: variant {variant!r} must be one of the non-control variants "
                             f"{[v for v in variants if v != control]}")
        metric = entry.get("metric")
        if metric is not None and metric not in tags:
            raise ValueError(f"{where}: metric {metric!r} is not one of the study's metrics {tags}")
        tut = {"effect": 0.0, "p": 1.0, "n": ""} if own else entry["tutorial"]
        if not isinstance(tut, dict) or not {"effect", "p", "n"} <= set(tut) or set(tut) - TUTORIAL_KEYS:
            raise ValueError(f"{where}: tutorial must be {{effect, p, n[, ci, text]}}, got {tut!r}")
        p = _number(f"{where}: tutorial.p", tut["p"])
        if not 0 < p <= 1:
            raise ValueError(f"{where}: tutorial.p must be in (0, 1], got {p}")
        ci = tut.get("ci")
        if ci is not None:
            if not (isinstance(ci, list) and len(ci) == 2):
                raise ValueError(f"{where}: tutorial.ci must be [low, high]")
            ci = (_number(f"{where}: tutorial.ci", ci[0]), _number(f"{where}: tutorial.ci", ci[1]))
        margin = entry.get("margin")
        if p >= ALPHA and margin is None:
            raise ValueError(f"{where}: a null claim (tutorial p >= {ALPHA}) needs `margin`, the smallest "
                             f"difference that would matter, in display units")
        if margin is not None and _number(f"{where}: margin", margin) <= 0:
            raise ValueError(f"{where}: margin must be > 0")
        out.append(Claim(str(entry["claim"]).strip(), variant, _number(f"{where}: tutorial.effect", tut["effect"]),
                         p, str(tut["n"]), ci, str(tut.get("text", "")).strip(),
                         None if margin is None else float(margin), metric, str(entry.get("measure", "")).strip(),
                         str(entry.get("earlier", "")).strip(), str(entry.get("differs", "")).strip(), own,
                         str(entry.get("margin_reason", "")).strip()))
    return out


def _fmt(x: float, decimals: int = 1) -> str:
    return f"{x:+.{decimals}f}"


def _power_note(mde: float, reference: float, decimals: int = 1) -> str | None:
    """Why the study could not tell, or None when an effect of size `reference` would be detected 80% of the
    time."""
    if math.isnan(mde):
        return "MDE not computable"
    if math.isinf(mde):
        return "underpowered: too few seeds for p < 0.05"
    if mde > reference:
        return (f"underpowered: an effect of {reference:.{decimals}f} would be detected less than 80% of the time "
                f"(MDE ±{mde:.{decimals}f})")
    return None


def _ci_text(lo: float, hi: float, decimals: int = 1) -> str:
    return (f"[{_fmt(lo, decimals)}, {_fmt(hi, decimals)}]" if math.isfinite(lo) and math.isfinite(hi)
            else "no finite CI")


def judge(claim: Claim, diff: float, lo: float, hi: float, p: float, mde: float,
          p_equivalence: float | None = None) -> Verdict:
    """The verdict for our `diff` [lo, hi] (display units), p (Holm-adjusted if several comparisons), MDE at 80%
    power and, for a null claim, the equivalence test's p at ±margin (TOST, Holm-adjusted alike), by the rule in
    the module docstring. NaN p (no paired seeds) raises: a missing run is not a verdict."""
    if math.isnan(p):
        raise ValueError("no paired result to judge")
    has_ci = math.isfinite(lo) and math.isfinite(hi)
    d = claim.decimals
    significant = p < ALPHA
    if claim.is_null:
        if p_equivalence is None or math.isnan(p_equivalence):
            raise ValueError("a null claim needs the equivalence test's p (TOST at its margin)")
        margin = float(claim.margin or 0.0)
        equivalent = p_equivalence < ALPHA
        tost = f"equivalence test (TOST at ±{margin:g}) p={format_p(p_equivalence)}"
        sign = ""
        if claim.effect and diff and (claim.effect > 0) != (diff > 0):
            sign = f"; opposite in sign to the tutorial's (non-significant) {_fmt(claim.effect, d)}"
        if equivalent and significant:
            return Verdict("equivalent (a small difference)",
                           f"a real difference of {_fmt(diff, d)} {_ci_text(lo, hi, d)}, p={format_p(p)}, but inside "
                           f"±{margin:g}, the margin that would matter: {tost}")
        if equivalent:
            return Verdict("equivalent" if claim.own else "reproduced",
                           f"no difference that matters: {tost}, difference p={format_p(p)}")
        if significant:
            if has_ci and (lo > margin or hi < -margin):  # the whole interval lies beyond the margin
                if claim.own:
                    return Verdict("different (beyond the margin)",
                                   f"a difference of {_fmt(diff, d)} {_ci_text(lo, hi, d)}, p={format_p(p)}, the whole "
                                   f"95% CI beyond ±{margin:g} ({tost})")
                return Verdict("refuted", f"a difference of {_fmt(diff, d)} {_ci_text(lo, hi, d)} where the tutorial "
                                          f"found none, the whole 95% CI beyond ±{margin:g} ({tost}){sign}")
            return Verdict("different (possibly inside the margin)",
                           f"a difference of {_fmt(diff, d)} {_ci_text(lo, hi, d)}, p={format_p(p)}, but its 95% CI "
                           f"reaches inside ±{margin:g}: not shown beyond the margin nor inside it ({tost}){sign}")
        weak = _power_note(mde, margin, d)
        if weak:
            return Verdict("inconclusive", f"{weak}; {tost}")
        return Verdict("inconclusive", f"not significant and not shown equivalent ({tost}): the 95% CI "
                                       f"{_ci_text(lo, hi, d)} reaches beyond ±{margin:g}")
    same_sign = (diff > 0) == (claim.effect > 0) and diff != 0
    excludes = has_ci and not lo <= claim.effect <= hi
    if significant and same_sign:
        size = ""
        if excludes:
            size = "; smaller than the tutorial's" if abs(diff) < abs(claim.effect) else "; larger than the tutorial's"
            size += f" (our CI excludes {_fmt(claim.effect, d)})"
            if claim.differs:  # "larger/smaller than the tutorial's" is a like-for-like statement only
                size += f", in settings that differ: {claim.differs}"
        return Verdict("reproduced", "same direction, p < 0.05" + size)
    if significant:
        return Verdict("refuted", f"the opposite direction ({_fmt(diff, d)}), p < 0.05")
    if excludes:
        return Verdict("refuted", f"an effect as large as the tutorial's is ruled out: our CI excludes "
                                  f"{_fmt(claim.effect, d)}")
    weak = _power_note(mde, abs(claim.effect), d)
    if weak:
        return Verdict("inconclusive", weak)
    return Verdict("inconclusive", f"not significant; effects outside the 95% CI {_ci_text(lo, hi, d)} are excluded, "
                                   f"and an effect of ±{mde:.{d}f} would be detected 80% of the time")
