"""ATen ops per decode step (flash-25m, 16 rows after a 64-token prompt), counted with torch.profiler: deterministic,
so it is the number to compare across commits for cached generation, which is bound by dispatch overhead.

    python -m benchmarks.profile_decode [--rows 16] [--by-frame]

`--by-frame` groups the ops by the innermost glm_lightning source frame (which code issues them).
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.profile_step import is_aten
from glm_lightning.generation import decode_cache
from glm_lightning.model import GLMConfig, GLMModel


def profile_decode(rows: int = 16, prompt_len: int = 64, by_frame: bool = False) -> tuple[int, collections.Counter]:
    """(ops of one decode step, ops per op name or per source frame) after a prefill and two untimed steps."""
    torch.manual_seed(0)
    model = GLMModel(GLMConfig.preset("flash-25m")).eval()
    prompt = torch.randint(0, 256, (1, prompt_len))
    tok = torch.randint(0, 256, (rows, 1))
    with torch.inference_mode():
        cache = decode_cache(model, 1, prompt_len + 48)
        model(prompt, valid=torch.ones_like(prompt, dtype=torch.bool), cache=cache)
        cache = cache.repeat_interleave(rows)
        for _ in range(2):
            model(tok, cache=cache)
        with profile(activities=[ProfilerActivity.CPU], with_stack=by_frame) as prof:
            model(tok, cache=cache)
    ops = [e for e in prof.events() if is_aten(e.name)]
    return len(ops), collections.Counter(_frame(e) if by_frame else e.name for e in ops)


def _frame(e) -> str:
    """The innermost glm_lightning source frame above a profiler event (python frames are events with stacks on)."""
    while e is not None:
        if "glm_lightning/" in e.name:
            return e.name
        e = e.cpu_parent
    return "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--by-frame", action="store_true")
    args = p.parse_args()
    n, counts = profile_decode(args.rows, by_frame=args.by_frame)
    for name, c in counts.most_common(args.top):
        print(f"{c:>6}  {name}")
    print(f"flash-25m, {args.rows} rows: {n} ATen ops per decode step")


if __name__ == "__main__":
    main()
