"""Where a DSA decode step should switch from masking all cached keys to gathering its top-k keys
(ops/thresholds.py, DECODE_GATHER_MIN_KEYS_PER_TOP_K): one flash-25m DSA layer's decode step (16 rows, top_k 64) at
several cache lengths, both forms alternated in one process, median microseconds per step.

    python -m benchmarks.bench_decode_gather [--rounds 7] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

from glm_lightning.model import GLMConfig
from glm_lightning.model.cache import DSACache
from glm_lightning.model.dsa import SparseAttention
from glm_lightning.model.ops import thresholds

LENGTHS = (100, 160, 256, 384, 512)
ROWS = 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    cfg = GLMConfig.preset("flash-25m", max_seq_len=max(LENGTHS) + 1)
    torch.manual_seed(0)
    layer = SparseAttention(cfg).eval()
    x = torch.randn(ROWS, max(LENGTHS) + 1, cfg.d_model)
    forms = {"mask": 10**9, "gather": 0}
    print(f"one flash-25m DSA layer's decode step, {ROWS} rows, top_k {cfg.index_top_k}, "
          f"{torch.get_num_threads()} threads; median us per step of {args.rounds} rounds")
    print(f"{'keys':>6} {'mask':>8} {'gather':>8} {'gather/mask':>12}")
    with torch.inference_mode():
        for n in LENGTHS:
            cache = DSACache.empty(ROWS, cfg)
            layer(x[:, :n - 1], cache=cache)
            times: dict[str, list[float]] = {f: [] for f in forms}
            for _ in range(args.rounds):
                for form, per_top_k in forms.items():
                    with mock.patch.object(thresholds, "DECODE_GATHER_MIN_KEYS_PER_TOP_K", per_top_k):
                        t = time.perf_counter()
                        for _ in range(args.steps):
                            cache.length = n - 1
                            layer(x[:, n - 1:n], cache=cache)
                        times[form].append((time.perf_counter() - t) / args.steps * 1e6)
            mask, gather = statistics.median(times["mask"]), statistics.median(times["gather"])
            print(f"{n:>6} {mask:>8.0f} {gather:>8.0f} {gather / mask:>11.2f}x")


if __name__ == "__main__":
    main()
