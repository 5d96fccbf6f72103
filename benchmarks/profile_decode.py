"""ATen ops per decode step (flash-25m, 16 rows after a 64-token prompt), counted with torch.profiler: deterministic,
so it is the number to compare across commits for cached generation, which is bound by dispatch overhead.

    python -m benchmarks.profile_decode [--rows 16] [--by-frame] [--time] [--precision bf16]

`--by-frame` groups the ops by the innermost glm_lightning source frame (which code issues them). `--time` also times
decode steps without the profiler (:func:`time_decode`): the median step, the part spent in the decode's few-row
matmuls (the C++ ops that stream the weights of the decode's linears and experts: ``panel_matmul`` on the weights
packed for the decode, else ``small_matmul``; timed around each call, so its time includes the call's own dispatch)
and the weight bytes they read, so a step splits into weight streaming and everything else (the other ops, Python and
dispatch); the matmuls are counted in further steps with the fused decode ops off (a fused op calls its matmuls from
C++). `--precision bf16` profiles the decode of generation's bf16 sampling copy (its weights read as bf16
panels; `--no-amx`: on the widened FMA kernel even where AMX tiles would run them).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.profile_step import is_aten
from glm_lightning.generation import decode_cache, sampling_weights
from glm_lightning.model import GLMConfig, GLMModel, cext
from glm_lightning.model.ops import decode


def profile_decode(rows: int = 16, prompt_len: int = 64, by_frame: bool = False,
                   precision: str = "32") -> tuple[int, collections.Counter]:
    """(ops of one decode step, ops per op name or per source frame) after a prefill and two untimed steps."""
    torch.manual_seed(0)
    model = sampling_weights(GLMModel(GLMConfig.preset("flash-25m")), precision).eval()
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


def time_decode(rows: int = 16, steps: int = 12, prompt_len: int = 64, preset: str = "flash-25m",
                precision: str = "32") -> dict[str, Any]:
    """Median CPU seconds (process time: the machine may be shared; 1 thread) of a decode step of ``rows`` rows (after
    a prefill and two untimed steps), and per step: the seconds inside the decode's few-row matmul calls
    (``panel_matmul`` on packed weights, or ``small_matmul``), their number and the weight bytes they read (a padded
    expert with no row is not read), measured in further steps with the fused decode ops (decode.FUSED) off, so that
    every matmul is a call of its own. The C++ ops must be loaded
    for them to run; without them these fields are 0."""
    from glm_lightning.model.ops import matmul, moe

    torch.manual_seed(0)
    model = sampling_weights(GLMModel(GLMConfig.preset(preset)), precision).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (1, prompt_len))
    tok = torch.randint(0, model.cfg.vocab_size, (rows, 1))
    acc = {"s": 0.0, "calls": 0, "bytes": 0}
    small, panel = matmul.small_matmul, matmul.panel_matmul

    def count(t: float, counts: torch.Tensor | None, matrix_bytes: int, matrices: int) -> None:
        acc["s"] += time.process_time() - t
        acc["calls"] += 1
        acc["bytes"] += matrix_bytes * (matrices if counts is None else int((counts > 0).sum()))

    def timed_small(x2, weight, counts, bias=None, swiglu=False):
        t = time.process_time()
        y = small(x2, weight, counts, bias, swiglu)
        count(t, counts, weight.shape[-2] * weight.shape[-1] * weight.element_size(), 1)
        return y

    def timed_panel(x, panels, out, counts, bias=None):
        t = time.process_time()
        y = panel(x, panels, out, counts, bias)
        count(t, counts, out * panels.shape[-2] * panels.element_size(), 1)
        return y

    times = []
    matmul.small_matmul = moe.small_matmul = timed_small
    matmul.panel_matmul = timed_panel
    try:
        with torch.inference_mode():
            cache = decode_cache(model, 1, prompt_len + 2 * steps + 4)
            model(prompt, valid=torch.ones_like(prompt, dtype=torch.bool), cache=cache)
            cache = cache.repeat_interleave(rows)
            for _ in range(2):
                model(tok, cache=cache)
            for _ in range(steps):
                t = time.process_time()
                model(tok, cache=cache)
                times.append(time.process_time() - t)
            # the matmuls inside the fused decode ops (block ops, moe_decode) are C++ calls nothing can wrap from
            # here: they are counted in steps with those ops off, each matmul its own call (same kernels, same bytes)
            with decode.without(decode.FUSED):
                model(tok, cache=cache)
                acc.update(s=0.0, calls=0, bytes=0)
                for _ in range(steps):
                    model(tok, cache=cache)
    finally:
        matmul.small_matmul = moe.small_matmul = small
        matmul.panel_matmul = panel
    sm = acc["s"] / steps
    return {"rows": rows, "step_s": statistics.median(times), "matmul_s": sm, "matmul_calls": acc["calls"] / steps,
            "matmul_bytes": acc["bytes"] / steps, "matmul_gbs": acc["bytes"] / steps / sm / 1e9 if sm else 0.0}


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
    p.add_argument("--time", action="store_true", help="also time decode steps (no profiler): the matmuls' share")
    p.add_argument("--precision", default="32", choices=("32", "bf16"), help="bf16: generation's bf16 sampling copy")
    p.add_argument("--no-amx", action="store_true",
                   help="bf16 panels on the widened FMA kernel even where AMX tiles (csrc/amx_panels.h) would run")
    args = p.parse_args()
    if args.no_amx and cext.available():
        torch.ops.glm_lightning.panel_amx(False)
    n, counts = profile_decode(args.rows, by_frame=args.by_frame, precision=args.precision)
    for name, c in counts.most_common(args.top):
        print(f"{c:>6}  {name}")
    print(f"flash-25m, {args.rows} rows, precision {args.precision}: {n} ATen ops per decode step")
    if args.time:
        from glm_lightning import machine

        r = time_decode(args.rows, precision=args.precision)
        rest = r["step_s"] - r["matmul_s"]
        print(f"{machine.describe()}: decode step {r['step_s'] * 1e3:.1f} ms (median), few-row matmuls "
              f"{r['matmul_s'] * 1e3:.1f} ms in {r['matmul_calls']:.0f} calls (timed with the fused decode ops off) "
              f"({r['matmul_bytes'] / 1e6:.1f} MB of weights, {r['matmul_gbs']:.1f} GB/s), the rest "
              f"{rest * 1e3:.1f} ms ({n} ATen ops: {rest / n * 1e6:.1f} us per op)")


if __name__ == "__main__":
    main()
