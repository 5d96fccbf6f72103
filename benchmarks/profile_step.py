"""Profile one training step (fwd + bwd + AdamW) with torch.profiler: the deterministic ATen op count, and where the
time goes, grouped by op and by op + input shape.

    python -m benchmarks.profile_step [--model flash-25m|study] [--top 25] [--by-shape]

`flash-25m` trains at 32 x 128; `study` is the `tiny` preset as configs/experiments/base_composition.yaml widens it,
at 8 x 128. The op count is what decides speed for the study model (dispatch-bound: ~15 us per op), so it is the
number to watch; times are indicative only on a loaded machine.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

from glm_lightning.model import GLMConfig, GLMModel
from glm_lightning.optim import AdamW

STUDY_OVERRIDES = dict(d_model=48, n_layers=3, n_heads=3, n_kv_heads=3, head_dim=16, max_seq_len=128,
                       expert_hidden=96, shared_expert_hidden=96)
"""The study model of configs/experiments/base_composition.yaml (kept in sync by tests/test_bench_profile.py)."""

MODELS = {"flash-25m": (("flash-25m", {}), 32, 128), "study": (("tiny", STUDY_OVERRIDES), 8, 128)}


def build(name: str) -> tuple[GLMModel, int, int]:
    """The model of a profile target and its batch shape (B, T)."""
    (preset, overrides), batch, seq = MODELS[name]
    torch.manual_seed(0)
    return GLMModel(GLMConfig.preset(preset, **overrides)), batch, seq


PHASES = ("forward", "backward", "optimizer")


def train_step(model: GLMModel, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    """One step, its phases labelled for the profiler: forward (incl. the loss), backward, optimizer (AdamW)."""
    with record_function("forward"):
        out = model(ids[:, :-1])
        loss = F.cross_entropy(out.logits.flatten(0, 1), ids[:, 1:].flatten()) + out.aux_loss
    with record_function("backward"):
        loss.backward()
    with record_function("optimizer"):
        opt.step()
        opt.zero_grad(set_to_none=True)


def is_aten(name: str) -> bool:
    """A dispatched op: ATen's, or one of the model's own C++ ops (glm_lightning/model/cext.py), counted alike."""
    return name.startswith(("aten::", "glm_lightning::"))


def make_optimizer(model: GLMModel) -> torch.optim.Optimizer:
    """AdamW as the training stages build it (glm_lightning/modules/base.py): torch's fused kernel with shared step
    counters (glm_lightning/optim.py), 2,573 (for-each) -> 583 (fused) -> 168 ops per step for the study model."""
    return AdamW(model.parameters(), lr=1e-4)


def profile_step(name: str, warmup: int = 1) -> tuple[Any, dict[str, int]]:
    """(profiler, ATen op count per phase and in total) of one training step after `warmup` untimed steps."""
    model, batch, seq = build(name)
    opt = make_optimizer(model)
    ids = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    for _ in range(warmup):
        train_step(model, opt, ids)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        train_step(model, opt, ids)
    return prof, count_aten_ops(prof)


def count_aten_ops(prof: Any) -> dict[str, int]:
    """Every ATen op call of the profiled region (nested calls included, e.g. aten::linear -> aten::addmm), by
    phase (the outermost record_function label, or "other") and in total."""
    counts = dict.fromkeys((*PHASES, "other"), 0)
    for e in prof.events():
        if not is_aten(e.name):
            continue
        top = e
        while top.cpu_parent is not None:
            top = top.cpu_parent
        counts[top.name if top.name in PHASES else "other"] += 1
    counts["total"] = sum(counts.values())
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", choices=sorted(MODELS), default="flash-25m")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--by-shape", action="store_true", help="also group by op and input shapes")
    p.add_argument("--sort", default="self_cpu_time_total", help="profiler table column to sort by (or 'count')")
    args = p.parse_args()
    prof, n_ops = profile_step(args.model)
    print(prof.key_averages().table(sort_by=args.sort, row_limit=args.top))
    if args.by_shape:
        print(prof.key_averages(group_by_input_shape=True).table(sort_by=args.sort, row_limit=args.top))
    print(f"{args.model}: {n_ops['total']} ATen ops per training step  ({n_ops})")


if __name__ == "__main__":
    main()
