"""Generation speed: 16 samples x 48 new tokens after a 64-token prompt, cached engine vs the naive loop that
re-runs the full forward for every token (the reference tutorial's method), and the cached rate against this machine's
limits (benchmarks/utilization.py): the compute bound (2 x active parameters x rows FLOPs per decode step at the fp32
GEMM peak) and the memory-bandwidth bound (the bytes a 16-row step reads, at the read bandwidth measured on a buffer of
that size). The cached time includes the prompt's prefill (one row, 64 tokens: a few % of the run). The model keeps
its decode's packed weights from one call to the next while they are unchanged (model/kept_panels.py), so the cached
rows are those of a later call (an evaluation loop); the first call, which packs them as any call after a weight
change (RL) does, has its own row.

    python -m benchmarks.bench_generation [--quick]
"""

from __future__ import annotations

import argparse
import copy
import resource
import time
from typing import Any

import torch

from benchmarks import utilization
from glm_lightning.generation import generate, generate_naive
from glm_lightning.model import GLMConfig, GLMModel


def run(quick: bool = False, samples: int = 16, prompt_len: int = 64, new_tokens: int = 48,
        rounds: int = 2, cached_repeats: int = 3) -> dict[str, Any]:
    """Cached and naive alternated `rounds` times in this process (the best time of each), so load on a shared
    machine hits both alike. Each round runs the cached engine `cached_repeats` times: one run is ~0.6 s against the
    naive loop's ~20 s, so a single short run read up to 1.4x apart between rounds on a shared machine."""
    torch.manual_seed(0)
    model = GLMModel(GLMConfig.preset("flash-25m")).eval()
    prompt = torch.randint(0, 256, (1, prompt_len))
    if quick:
        new_tokens, rounds, cached_repeats = 16, 1, 1
    cached_s = naive_s = float("inf")
    generate(copy.deepcopy(model), prompt, max_new_tokens=2, num_samples=samples)  # the process's one-time costs
    t = time.perf_counter()
    generate(model, prompt, max_new_tokens=new_tokens, num_samples=samples, temperature=1.0, eos_id=None,
             generator=torch.Generator().manual_seed(0))
    first_s = time.perf_counter() - t
    for _ in range(rounds):
        for _ in range(cached_repeats):
            t = time.perf_counter()
            gen = generate(model, prompt, max_new_tokens=new_tokens, num_samples=samples, temperature=1.0,
                           eos_id=None, generator=torch.Generator().manual_seed(0))
            cached_s = min(cached_s, time.perf_counter() - t)
        t = time.perf_counter()
        generate_naive(model, prompt.expand(samples, -1).contiguous(), max_new_tokens=new_tokens, eos_id=None)
        naive_s = min(naive_s, time.perf_counter() - t)
    n = samples * new_tokens
    res = {"samples": samples, "prompt_len": prompt_len, "new_tokens": new_tokens, **utilization.machine_fields(),
           "cached_tokens_per_s": n / cached_s, "cached_first_call_tokens_per_s": n / first_s,
           "naive_tokens_per_s": n / naive_s, "speedup": naive_s / cached_s,
           "generated": int(gen.lengths.sum()), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    res.update(bounds(model, samples, prompt_len + new_tokens / 2, res["cached_tokens_per_s"], quick))
    print(f"generation, flash-25m, {samples} samples x {new_tokens} new tokens after a {prompt_len}-token prompt, "
          f"{res['machine']}")
    print(f"{'engine':<28}{'tokens/s':>10}{'seconds':>9}")
    print(f"{'cached (KDA state + KV)':<28}{res['cached_tokens_per_s']:>10.0f}{cached_s:>9.2f}")
    print(f"{'cached, first call (packs)':<28}{res['cached_first_call_tokens_per_s']:>10.0f}{first_s:>9.2f}")
    print(f"{'naive full re-forward':<28}{res['naive_tokens_per_s']:>10.0f}{naive_s:>9.2f}")
    print(f"speed-up: {res['speedup']:.1f}x (best of {rounds} alternated rounds, the cached engine {cached_repeats}x "
          f"per round)   peak RSS {res['peak_rss_mb']:.0f} MB")
    print(f"cached vs its bounds: {res['compute_bound_fraction']:.1%} of the compute bound "
          f"({res['compute_bound_tokens_per_s']:,.0f} tok/s: {utilization.DECODE_FLOPS}, fp32 GEMM peak "
          f"{res['peak_gflops']:.1f} GFLOP/s), {res['bandwidth_bound_fraction']:.1%} of the bandwidth bound "
          f"({res['bandwidth_bound_tokens_per_s']:,.0f} tok/s: {res['bytes_per_step'] / 1e6:.1f} MB per {samples}-row "
          f"step at {res['bandwidth_gbs']:.1f} GB/s)")
    return res


def bounds(model: GLMModel, rows: int, mean_length: float, tokens_per_s: float, quick: bool = False) -> dict[str, Any]:
    """The cached rate against the compute bound and the bandwidth bound of a decode step of ``rows`` rows."""
    peak = utilization.peaks(torch.get_num_threads(), quick)["fp32"]
    active = model.num_parameters()["active"]
    step = utilization.model_decode_bytes(model, rows, mean_length)
    bw = utilization.read_bandwidth_gbs(step["bytes"], 3 if quick else 10)
    compute = utilization.decode_compute_bound(active, peak)
    memory = utilization.decode_bandwidth_bound(step["bytes"], rows, bw)
    return {"peak_gflops": peak, "params_active": active, "flop_count": utilization.DECODE_FLOPS,
            "bytes_per_step": step["bytes"], "cache_bytes_per_step": step["cache_bytes"], "bandwidth_gbs": bw,
            "compute_bound_tokens_per_s": compute, "compute_bound_fraction": tokens_per_s / compute,
            "bandwidth_bound_tokens_per_s": memory, "bandwidth_bound_fraction": tokens_per_s / memory}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    run(p.parse_args().quick)
