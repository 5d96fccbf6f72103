"""Which evaluation of each run a study scores (`score_at:` in a study file): by default a run's last logged value;
with `score_at: {evaluation: k, completions: N}`, point k of its evaluation curve (point 0 is the evaluation before
training), checked at load time to fall at exactly N training completions in every variant.

Why: an RL run with a step budget (`trainer.max_steps`) makes no step on a batch whose groups all have equal
rewards, so it draws more completions than planned, and different arms draw different numbers (issue 47: the RL
screen's runs were scored after 128-384 completions). `val_check_interval` counts batches, so the k-th evaluation
falls at k x val_check_interval x batch_size x G completions whatever the skipped groups: scoring it compares the
arms at equal completions from runs already made. The arithmetic is checked against the base config and every
variant's overrides, so a variant whose k-th evaluation is elsewhere is refused instead of silently compared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class ScoreAt:
    evaluation: int
    """k >= 1: curve point k of every metric (point 0 is the start evaluation)."""
    completions: int | None = None
    """Training completions at that evaluation, checked per variant (RL studies)."""
    reason: str = ""

    def describe(self) -> str:
        at = f" ({self.completions} training completions in every arm)" if self.completions else ""
        return f"evaluation {self.evaluation} after the start{at}"


def parse_score_at(where: str, raw: Any) -> ScoreAt | None:
    """`score_at:` of a study file (None when absent)."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) - {"evaluation", "completions", "reason"} or "evaluation" not in raw:
        raise ValueError(f"{where}: score_at must be {{evaluation: k, completions: N, reason: ...}}, got {raw!r}")
    k, n = raw["evaluation"], raw.get("completions")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"{where}: score_at.evaluation must be an int >= 1 (0 is the start), got {k!r}")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"{where}: score_at.completions must be an int >= 1, got {n!r}")
    return ScoreAt(k, n, str(raw.get("reason") or "").strip())


def _lookup(config: dict[str, Any], overrides: dict[str, Any], key: str) -> Any:
    if key in overrides:
        return overrides[key]
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def completions_at(base: Path, overrides: dict[str, Any], evaluation: int) -> int:
    """Training completions drawn by the `evaluation`-th validation of a run of `base` with `overrides`:
    evaluation x val_check_interval (batches) x batch_size x G, capped by a `budget.completions` (the run then ends
    with its final evaluation at the batch that spends it)."""
    config = yaml.safe_load(base.read_text()) or {}
    keys = {"interval": "trainer.val_check_interval", "batch": "data.init_args.batch_size",
            "g": "model.init_args.sampling.group_size"}
    got = {name: _lookup(config, overrides, key) for name, key in keys.items()}
    missing = [keys[name] for name, v in got.items() if not isinstance(v, int) or isinstance(v, bool)]
    if missing:
        raise ValueError(f"cannot count completions: {', '.join(missing)} must be set as integers")
    per_batch = got["batch"] * got["g"]
    n = evaluation * got["interval"] * per_batch
    budget = _lookup(config, overrides, "model.init_args.budget.completions")
    if isinstance(budget, int) and not isinstance(budget, bool):
        n = min(n, math.ceil(budget / per_batch) * per_batch)
    return n


def point(curve: list[tuple[int, float]] | list[list[float]], evaluation: int) -> float | None:
    """Value of curve point `evaluation` (None when the run has fewer evaluations)."""
    return float(curve[evaluation][1]) if curve is not None and len(curve) > evaluation else None
