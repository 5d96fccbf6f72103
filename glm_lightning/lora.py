"""Low-rank adapters (LoRA, Hu et al. 2021, arXiv 2106.09685) on chosen weight matrices, mergeable afterwards.

A frozen weight W [out, in] is used as  W' = W + (alpha / r) * B @ A  with A [r, in], B [out, r], and B = 0 at the
start, so the adapted model is exactly the original until the adapters learn. Fine-tuning then moves r * (in + out)
numbers per matrix instead of in * out, which limits how far the language model can drift (the point for vision
fine-tuning that must keep the model's text skill).

The adapter is a `torch.nn.utils.parametrize` parametrization of the weight *parameter*, not a wrapper module, so
every way the model consumes the weight keeps working: `F.linear`, a fused `torch.cat` of q/k/v weights, a raw
`nn.Parameter` matrix. Targets are chosen by glob patterns on parameter names, like the FreezeCallback:

    names = apply_lora(model, ["blocks.*.mixer.*_proj.weight"], rank=8, alpha=16)
    ...train only the `lora_` parameters...
    merge_lora(model)   # W <- W + (alpha/r) B A; the parametrizations are removed, the state dict is plain again
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from fnmatch import fnmatchcase

import torch
from torch import nn
from torch.nn.utils import parametrize


class LowRankDelta(nn.Module):
    """The parametrization W -> W + scale * B @ A (B starts at zero: the identity at initialisation)."""

    def __init__(self, out_features: int, in_features: int, rank: int, alpha: float) -> None:
        super().__init__()
        self.scale = alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's default init, as in the paper's code

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        # Recomputed on every call, also without autograd: a cache keyed on version counters goes stale, because
        # fused AdamW updates parameters in place without bumping them.
        return torch.addmm(weight, self.lora_B, self.lora_A, alpha=self.scale)


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_name, _, leaf = name.rpartition(".")
    return (root.get_submodule(module_name) if module_name else root), leaf


def check_low_rank_args(patterns: Sequence[str], rank: int, alpha: float, what: str) -> None:
    """ValueError unless `patterns` is a non-empty list of glob strings, `rank` a positive int and `alpha` > 0
    (the arguments of every low-rank adapter here: LoRA, image-token adapters)."""
    if isinstance(patterns, str) or not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(f"{what} target patterns must be a non-empty list of glob strings, got {patterns!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{what} rank must be a positive int, got {rank!r}")
    if not alpha > 0:
        raise ValueError(f"{what} alpha must be > 0, got {alpha!r}")


def apply_lora(model: nn.Module, patterns: Sequence[str], rank: int = 8, alpha: float = 16.0) -> list[str]:
    """Add an adapter to every 2-D weight whose parameter name matches a glob pattern; return the adapted names.

    A pattern that matches no 2-D parameter is a ValueError naming the closest parameter names."""
    check_low_rank_args(patterns, rank, alpha, "LoRA")
    if any(parametrize.is_parametrized(m) for m in model.modules()):
        raise ValueError("the model already has parametrized weights (apply_lora was called twice?)")
    params = dict(model.named_parameters())
    targets: list[str] = []
    for pattern in patterns:
        hits = [n for n, p in params.items() if fnmatchcase(n, pattern)]
        matrices = [n for n in hits if params[n].dim() == 2]
        if not matrices:
            why = f"matches only non-matrix parameters {hits[:4]}" if hits else "matches no parameter"
            close = difflib.get_close_matches(pattern, list(params), n=5, cutoff=0.3)
            raise ValueError(f"LoRA pattern {pattern!r} {why}; closest names: {close or list(params)[:5]}")
        targets += [n for n in matrices if n not in targets]
    for name in targets:
        module, leaf = _owner(model, name)
        out_features, in_features = params[name].shape
        if rank > min(out_features, in_features):
            raise ValueError(f"LoRA rank {rank} exceeds the smaller side of {name} {tuple(params[name].shape)}")
        delta = LowRankDelta(out_features, in_features, rank, alpha).to(params[name])
        parametrize.register_parametrization(module, leaf, delta)
    return targets


def lora_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The adapters' own parameters (names contain `lora_A` / `lora_B`)."""
    return [(n, p) for n, p in model.named_parameters() if ".lora_A" in n or ".lora_B" in n]


def merge_lora(model: nn.Module) -> int:
    """Fold every adapter into its weight and remove the parametrizations; returns how many were merged."""
    merged = 0
    for module in list(model.modules()):
        if not parametrize.is_parametrized(module):
            continue
        for leaf in list(module.parametrizations.keys()):
            if any(isinstance(p, LowRankDelta) for p in module.parametrizations[leaf]):
                with torch.no_grad():
                    parametrize.remove_parametrizations(module, leaf, leave_parametrized=True)
                merged += 1
    return merged


def is_lora_parametrized(model: nn.Module) -> bool:
    """Whether any weight of `model` still carries an (unmerged) adapter."""
    return any(parametrize.is_parametrized(m) and any(isinstance(p, LowRankDelta) for ps in m.parametrizations.values()
                                                      for p in ps) for m in model.modules())


def _merged_key(base: str) -> str:
    """`a.b.parametrizations.weight` -> `a.b.weight` (the key of the plain, merged weight)."""
    owner, _, leaf = base.rpartition("parametrizations.")
    return owner + leaf


def lora_checkpoint_state(model: nn.Module, state: dict[str, torch.Tensor],
                          ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split the state dict of an adapted `model` into (a plain state dict with every adapter merged into its
    weight, the adapter entries). The plain one loads into the unadapted model (later stages, `init_weights`); the
    adapter entries let :func:`restore_lora_state` rebuild the exact adapted state for resuming."""
    plain, saved = dict(state), {}
    for path, module in model.named_modules():
        if not parametrize.is_parametrized(module):
            continue
        for leaf, chain in module.parametrizations.items():
            if not any(isinstance(p, LowRankDelta) for p in chain):
                continue
            base = f"{path}.parametrizations.{leaf}" if path else f"parametrizations.{leaf}"
            for key in [k for k in plain if k.startswith(base + ".")]:
                saved[key] = plain.pop(key)
            weight = saved[f"{base}.original"]
            with torch.no_grad():
                for i, delta in enumerate(chain):  # the same arithmetic as the forward pass
                    weight = torch.addmm(weight, saved[f"{base}.{i}.lora_B"], saved[f"{base}.{i}.lora_A"],
                                         alpha=delta.scale)
            plain[_merged_key(base)] = weight
    return plain, saved


def restore_lora_state(plain: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`lora_checkpoint_state`: the adapted state dict (merged weights replaced by base + adapters)."""
    state = dict(plain)
    for key in saved:
        if key.endswith(".original"):
            state.pop(_merged_key(key.removesuffix(".original")), None)
    state.update(saved)
    return state
