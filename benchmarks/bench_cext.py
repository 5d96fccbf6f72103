"""The model's optional C++ ops (glm_lightning/model/cext.py) on vs off: study-model training steps (fwd + bwd +
AdamW) alternated in one process, so load on a shared machine hits both alike, and the ATen op count of each.

    python -m benchmarks.bench_cext [--rounds 7]

"off" is the eager fallback that runs when GLM_LIGHTNING_EXT=0 or when no compiler is available.
"""

from __future__ import annotations

import argparse
import resource
import time
from typing import Any
from unittest import mock

import torch

from benchmarks.profile_step import build, make_optimizer, profile_step, train_step
from glm_lightning.model import cext


def _timed_step(model, opt, ids) -> float:
    t = time.perf_counter()
    train_step(model, opt, ids)
    return time.perf_counter() - t


def run(quick: bool = False, rounds: int = 7) -> dict[str, Any]:
    if not cext.available():
        print("C++ ops not available (GLM_LIGHTNING_EXT=0 or no compiler): nothing to compare")
        return {"available": False}
    rounds = 3 if quick else rounds
    model, batch, seq = build("study")
    opt = make_optimizer(model)
    ids = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(rounds):
        for mode in times:
            with mock.patch.object(cext, "available", lambda mode=mode: mode == "on"):
                train_step(model, opt, ids)  # the first step after a switch is not timed
                times[mode].append(_timed_step(model, opt, ids))
    med = {m: sorted(t)[len(t) // 2] for m, t in times.items()}
    with mock.patch.object(cext, "available", lambda: False):
        ops_off = profile_step("study")[1]["total"]
    ops_on = profile_step("study")[1]["total"]
    res = {"available": True, "rounds": rounds, "seconds_per_step_off": med["off"], "seconds_per_step_on": med["on"],
           "speedup": med["off"] / med["on"], "ops_off": ops_off, "ops_on": ops_on,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    print(f"study model training step, C++ ops off vs on, {rounds} alternated rounds, {torch.get_num_threads()} thr")
    print(f"{'C++ ops':<10}{'s/step':>9}{'ATen ops':>10}")
    print(f"{'off':<10}{med['off']:>9.3f}{ops_off:>10}")
    print(f"{'on':<10}{med['on']:>9.3f}{ops_on:>10}")
    print(f"on / off: {res['speedup']:.2f}x faster")
    return res


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=7)
    run(rounds=p.parse_args().rounds)
