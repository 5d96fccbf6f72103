"""Per-group learning rates chosen by parameter-name patterns (encoder, LM blocks, embeddings, norms, adapters).

Fine-tuning a pre-trained language model for a new input (vision) forgets less when the parts that hold the language
skill move slowly or not at all while the new parts move fast. A group is a name, glob patterns and a learning rate:

    lr_groups:
      - {name: adapters,   params: ["*.lora_A", "*.lora_B"], lr: 3.0e-3}
      - {name: encoder,    params: ["vision.*"],            lr: 3.0e-3}
      - {name: embeddings, params: ["model.embed.*", "model.lm_head.*"], lr: 0}     # 0 = frozen
      - {name: norms,      params: ["model.*norm*"],        lr: 3.0e-4}
      - {name: blocks,     params: ["model.blocks.*"]}                             # no lr = the stage's lr

Each parameter joins the FIRST group whose pattern matches (list specific groups first); parameters no group
matches train at the stage's lr. `lr: 0` freezes a group (its parameters get ``requires_grad = False``, so nothing
is computed for them). Every group is split into a decayed and a non-decayed optimizer group
(:func:`glm_lightning.modules.base.no_weight_decay`); each keeps its `name` so LearningRateMonitor logs
``lr-AdamW/<name>`` and ``lr-AdamW/<name>/no_decay``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch

from glm_lightning.modules.base import no_weight_decay

GROUP_KEYS = {"name", "params", "lr"}


@dataclass(frozen=True)
class LrGroup:
    name: str
    params: tuple[str, ...]
    lr: float | None  # None: the stage's lr

    def matches(self, name: str) -> bool:
        return any(fnmatchcase(name, p) for p in self.params)


def parse_lr_groups(specs: Sequence[dict[str, Any]] | None) -> list[LrGroup]:
    """Check the YAML form (a list of {name, params, lr}) and return the groups; errors say which entry is wrong."""
    if specs is None:
        return []
    if isinstance(specs, (str, dict)) or not isinstance(specs, Sequence):
        raise ValueError(f"lr_groups must be a list of {{name, params, lr}} mappings, got {specs!r}")
    groups: list[LrGroup] = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict):
            raise ValueError(f"lr_groups[{i}] must be a mapping {{name, params, lr}}, got {spec!r}")
        extra = set(spec) - GROUP_KEYS
        if extra:
            raise ValueError(f"lr_groups[{i}]: unknown key(s) {sorted(extra)}; allowed: {sorted(GROUP_KEYS)}")
        name, params, lr = spec.get("name"), spec.get("params"), spec.get("lr")
        if not isinstance(name, str) or not name or any(g.name == name for g in groups):
            raise ValueError(f"lr_groups[{i}]: `name` must be a non-empty string used once, got {name!r}")
        if isinstance(params, str) or not isinstance(params, Sequence) or not params \
                or not all(isinstance(p, str) and p for p in params):
            raise ValueError(f"lr_groups[{i}] ({name}): `params` must be a non-empty list of glob patterns, "
                             f"got {params!r}")
        if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr < 0):
            raise ValueError(f"lr_groups[{i}] ({name}): `lr` must be a number >= 0 (0 = frozen) or absent, got {lr!r}")
        groups.append(LrGroup(name, tuple(params), None if lr is None else float(lr)))
    return groups


def assign_groups(names: Iterable[str], groups: Sequence[LrGroup]) -> dict[str, str]:
    """parameter name -> group name (first match; `rest` when none). A pattern matching no name is an error."""
    names = list(names)
    for g in groups:
        for pattern in g.params:
            if not any(fnmatchcase(n, pattern) for n in names):
                raise ValueError(f"lr group {g.name!r}: pattern {pattern!r} matches no parameter "
                                 f"(names look like: {', '.join(names[:6])}, ...)")
    out = {}
    for n in names:
        out[n] = next((g.name for g in groups if g.matches(n)), "rest")
    return out


def build_param_groups(named: Iterable[tuple[str, torch.nn.Parameter]], groups: Sequence[LrGroup],
                       base_lr: float, weight_decay: float) -> list[dict[str, Any]]:
    """Optimizer param groups (named, with their own lr) of the parameters that still train; lr-0 groups freeze
    their parameters. Parameters already frozen (``requires_grad = False``, e.g. by a FreezeCallback) stay out."""
    named = list(named)
    which = assign_groups((n for n, _ in named), groups)
    lrs = {g.name: (base_lr if g.lr is None else g.lr) for g in groups}
    lrs["rest"] = base_lr
    buckets: dict[tuple[str, bool], list[torch.nn.Parameter]] = {}
    for n, p in named:
        group = which[n]
        if lrs[group] == 0:
            p.requires_grad_(False)
        if p.requires_grad:
            buckets.setdefault((group, no_weight_decay(n, p)), []).append(p)
    out = []
    for (group, skip_decay), params in buckets.items():
        out.append({"params": params, "lr": lrs[group], "name": f"{group}/no_decay" if skip_decay else group,
                    "weight_decay": 0.0 if skip_decay else weight_decay})
    if not out:
        raise ValueError("no trainable parameters (every group is frozen)")
    return out
