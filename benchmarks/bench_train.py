"""Training throughput of flash-25m (fwd + bwd + AdamW, batch 32 x 128) vs a dense baseline of equal ACTIVE size,
with MFU against this machine's fp32 matmul peak measured in the same run, and the peak RSS after each row (the
dense baseline runs first, so the hybrid's figure is its own peak).

    python -m benchmarks.bench_train [--quick]
"""

from __future__ import annotations

import argparse
import resource
import time
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.dense_baseline import dense_matching_active
from glm_lightning.model import GLMConfig, GLMModel


def matmul_peak_gflops(n: int = 1536, reps: int = 8) -> float:
    """Best-of fp32 GEMM rate (GFLOP/s) with the current thread count."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - t) / 1e9)
    return best


def time_steps(model: torch.nn.Module, loss_fn, batch: int, seq: int, steps: int, warmup: int = 2) -> float:
    """Median seconds per optimizer step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 256, (batch, seq + 1))
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        loss = loss_fn(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def hybrid_loss(model: GLMModel, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids[:, :-1])
    return F.cross_entropy(out.logits.flatten(0, 1), ids[:, 1:].flatten()) + out.aux_loss


def dense_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


def run(quick: bool = False, batch: int = 32, seq: int = 128) -> dict[str, Any]:
    torch.manual_seed(0)
    steps = 2 if quick else 5
    cfg = GLMConfig.preset("flash-25m")
    hybrid = GLMModel(cfg)
    counts = hybrid.num_parameters()
    dense = dense_matching_active(cfg, counts["active"])
    dense_params = sum(p.numel() for p in dense.parameters())
    peak = matmul_peak_gflops()
    tokens = batch * seq
    res: dict[str, Any] = {"batch": batch, "seq": seq, "threads": torch.get_num_threads(), "peak_gflops": peak}
    for name, model, fn, n_active in (("dense baseline", dense, dense_loss, dense_params),
                                      ("hybrid flash-25m", hybrid, hybrid_loss, counts["active"])):
        sec = time_steps(model, fn, batch, seq, steps)
        flops = 6 * n_active * tokens
        res[name] = {"params_active": n_active, "s_per_step": sec, "tokens_per_s": tokens / sec,
                     "mfu": flops / sec / 1e9 / peak,
                     "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    res["hybrid_over_dense"] = res["hybrid flash-25m"]["tokens_per_s"] / res["dense baseline"]["tokens_per_s"]
    res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"training throughput (fwd+bwd+AdamW, batch {batch}x{seq}, {res['threads']} threads, "
          f"fp32 matmul peak {peak:.1f} GFLOP/s)")
    print(f"{'model':<20}{'active params':>15}{'s/step':>9}{'tokens/s':>11}{'MFU':>8}{'RSS MB':>8}")
    for name in ("hybrid flash-25m", "dense baseline"):
        r = res[name]
        print(f"{name:<20}{r['params_active']:>15,}{r['s_per_step']:>9.2f}{r['tokens_per_s']:>11.0f}"
              f"{r['mfu']:>8.1%}{r['peak_rss_mb']:>8.0f}")
    print(f"hybrid / dense throughput: {res['hybrid_over_dense']:.2f}x   peak RSS {res['peak_rss_mb']:.0f} MB")
    return res


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    run(p.parse_args().quick)
