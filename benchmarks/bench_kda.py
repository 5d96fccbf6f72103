"""KDA's core, forward + backward: the chunked form as it runs without the C++ ops (kda_chunk.KDAChunkFunction, eager)
vs the C++ per-token recurrence the layer runs with them (kda.kda_core, csrc/kda_recurrent.cpp), alternated in one
process at the shapes of a flash-25m training step (32 x 128, 6 heads of 32, chunks of 32) and of the study model
(8 x 128, 3 heads of 16, chunks of 16).

    python -m benchmarks.bench_kda [--rounds 7]
"""

from __future__ import annotations

import argparse
import resource
import time
from typing import Any

import torch
import torch.nn.functional as F

from glm_lightning.model import cext
from glm_lightning.model.ops import kda_chunked, kda_core

SHAPES = {"flash-25m": (32, 128, 6, 32, 32), "study": (8, 128, 3, 16, 16)}
"""name -> (B, T, H, K = V, chunk size) as the model runs them (the safe gate's bound 5)."""


def _inputs(B: int, T: int, H: int, K: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1) * K ** -0.5
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, K, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    s0 = torch.zeros(B, H, K, K)
    return [x.requires_grad_() for x in (q, k, v, g, beta, s0)]


def _step(xs: list[torch.Tensor], chunk: int, cpp: bool) -> float:
    t = time.perf_counter()
    core = kda_core if cpp else kda_chunked
    o, s = core(*xs[:5], chunk, xs[5], gate_bound=5.0, cpp=cpp)
    torch.autograd.grad(o.sum() + s.sum(), xs)
    return time.perf_counter() - t


def run(quick: bool = False, rounds: int = 7) -> dict[str, Any]:
    if not cext.available():
        print("C++ ops not available (GLM_LIGHTNING_EXT=0 or no compiler): nothing to compare")
        return {"available": False}
    rounds = 3 if quick else rounds
    res: dict[str, Any] = {"available": True, "rounds": rounds}
    print(f"KDA core fwd+bwd per layer, eager chunked vs C++ recurrence, best of {rounds} alternated rounds, "
          f"{torch.get_num_threads()} thr")
    print(f"{'shape':<12}{'eager ms':>10}{'C++ ms':>10}{'ratio':>8}")
    for name, shape in SHAPES.items():
        xs = _inputs(*shape[:4])
        times: dict[str, list[float]] = {"eager": [], "cpp": []}
        for _ in range(rounds):
            for mode in times:
                times[mode].append(_step(xs, shape[4], cpp=mode == "cpp"))
        best = {m: min(t) for m, t in times.items()}
        res[name] = {"eager_ms": best["eager"] * 1e3, "cpp_ms": best["cpp"] * 1e3,
                     "speedup": best["eager"] / best["cpp"]}
        print(f"{name:<12}{best['eager'] * 1e3:>10.2f}{best['cpp'] * 1e3:>10.2f}{best['eager'] / best['cpp']:>7.2f}x")
    res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=7)
    run(rounds=p.parse_args().rounds)


if __name__ == "__main__":
    main()
