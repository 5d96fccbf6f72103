"""Generation speed: 16 samples x 48 new tokens after a 64-token prompt, cached engine vs the naive loop that
re-runs the full forward for every token (the reference tutorial's method).

    python -m benchmarks.bench_generation [--quick]
"""

from __future__ import annotations

import argparse
import resource
import time
from typing import Any

import torch

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
    res = {"samples": samples, "prompt_len": prompt_len, "new_tokens": new_tokens,
           "cached_tokens_per_s": n / cached_s, "naive_tokens_per_s": n / naive_s, "speedup": naive_s / cached_s,
           "generated": int(gen.lengths.sum()), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    print(f"generation, flash-25m, {samples} samples x {new_tokens} new tokens after a {prompt_len}-token prompt")
    print(f"{'engine':<28}{'tokens/s':>10}{'seconds':>9}")
    print(f"{'cached (KDA state + KV)':<28}{res['cached_tokens_per_s']:>10.0f}{cached_s:>9.2f}")
    print(f"{'naive full re-forward':<28}{res['naive_tokens_per_s']:>10.0f}{naive_s:>9.2f}")
    print(f"speed-up: {res['speedup']:.1f}x (best of {rounds} alternated rounds, the cached engine {cached_repeats}x "
          f"per round)   peak RSS {res['peak_rss_mb']:.0f} MB")
    return res


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    run(p.parse_args().quick)
