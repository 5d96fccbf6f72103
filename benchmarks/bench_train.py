"""Training throughput of flash-25m (fwd + bwd + AdamW, batch 32 x 128) vs a dense baseline of equal ACTIVE size,
with MFU against this machine's fp32 matmul peak measured in the same run, and the peak RSS after each row (the
dense baseline's is taken before the hybrid first runs; the hybrid's is the process peak). The two models take turns
(3 rounds of an untimed and two timed steps each), each row is the median step, and both use the stages' optimizer
(glm_lightning/optim.py). The matmul peak is the best of a measurement before and one after the steps.

    python -m benchmarks.bench_train [--quick]
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import utilization
from benchmarks.dense_baseline import dense_matching_active
from glm_lightning.model import GLMConfig, GLMModel
from glm_lightning.optim import AdamW


def matmul_peak_gflops(n: int = 1536, reps: int = 8) -> float:
    """Best-of fp32 GEMM rate (GFLOP/s) with the current thread count (benchmarks/utilization.py)."""
    return utilization.gemm_peak_gflops(torch.float32, n, reps)


def make_step(model: torch.nn.Module, loss_fn, batch: int, seq: int) -> Callable[[], float]:
    """A function that runs one optimizer step (fwd + bwd + the stages' AdamW, glm_lightning/optim.py, for both
    models) and returns its seconds."""
    opt = AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 256, (batch, seq + 1))

    def step() -> float:
        t = time.perf_counter()
        loss = loss_fn(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t
    return step


def time_in_turns(steps: dict[str, Callable[[], float]], rounds: int, per_turn: int = 2) -> dict[str, float]:
    """Median seconds per step of each model, the models taking turns (each turn: one untimed step, then per_turn
    timed ones), so that load changes on a shared machine hit both alike: with the dense phase run before the hybrid
    one, the unchanged dense model alone read 2.22-2.61 s/step across four runs of one sitting. Not step by step:
    that way the hybrid's median step read 3.27 s against 2.71-2.85 s in runs of its own steps in the same hour
    (those with torch's AdamW, which is slower); we suspect each model's first step after the other's pays again for
    its memory (not measured), which training never does."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            step()
            times[name] += [step() for _ in range(per_turn)]
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def hybrid_loss(model: GLMModel, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids[:, :-1])
    return F.cross_entropy(out.logits.flatten(0, 1), ids[:, 1:].flatten()) + out.aux_loss


def dense_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


def run(quick: bool = False, batch: int = 32, seq: int = 128) -> dict[str, Any]:
    torch.manual_seed(0)
    rounds = 1 if quick else 3
    cfg = GLMConfig.preset("flash-25m")
    hybrid = GLMModel(cfg)
    counts = hybrid.num_parameters()
    dense = dense_matching_active(cfg, counts["active"])
    dense_params = sum(p.numel() for p in dense.parameters())
    peak = matmul_peak_gflops()
    tokens = batch * seq
    res: dict[str, Any] = {"batch": batch, "seq": seq, **utilization.machine_fields(), "peak_gflops": peak,
                           "flop_count": utilization.TRAIN_FLOPS}
    rows = (("dense baseline", dense, dense_loss, dense_params), ("hybrid flash-25m", hybrid, hybrid_loss,
                                                                   counts["active"]))
    dense_step = make_step(dense, dense_loss, batch, seq)
    dense_step()
    rss_dense = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before the hybrid ever ran
    secs = time_in_turns({"dense baseline": dense_step,
                          "hybrid flash-25m": make_step(hybrid, hybrid_loss, batch, seq)}, rounds)
    peak = res["peak_gflops"] = max(peak, matmul_peak_gflops())  # the best of two measurements, before and after
    for name, model, fn, n_active in rows:
        sec = secs[name]
        per_token = utilization.train_flops_per_token(n_active)
        res[name] = {"params_active": n_active, "flops_per_token": per_token, "s_per_step": sec,
                     "tokens_per_s": tokens / sec, "mfu": utilization.mfu(tokens / sec, per_token, peak),
                     "peak_rss_mb": rss_dense if name == "dense baseline"
                     else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    # attention's weightless products, left out of the count: their share of the hybrid's FLOPs (DSA layers, each
    # query over min(t + 1, top_k) keys, fwd + bwd)
    keys = sum(min(t + 1, cfg.index_top_k) for t in range(seq)) / seq
    attn = utilization.attention_flops_per_token(cfg.layer_kinds.count("S"), cfg.n_heads, cfg.head_dim, keys)
    res["attention_flops_share"] = attn / (res["hybrid flash-25m"]["flops_per_token"] + attn)
    res["hybrid_over_dense"] = res["hybrid flash-25m"]["tokens_per_s"] / res["dense baseline"]["tokens_per_s"]
    res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"training throughput (fwd+bwd+AdamW, batch {batch}x{seq}) on {res['machine']}, "
          f"fp32 GEMM peak {peak:.1f} GFLOP/s")
    print(f"MFU: {utilization.TRAIN_FLOPS}; attention would add {res['attention_flops_share']:.1%} of the hybrid's")
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
