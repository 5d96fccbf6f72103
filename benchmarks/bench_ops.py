"""ATen ops per training step (fwd + bwd + AdamW), counted with torch.profiler: deterministic, so it is the number
to compare across commits on a noisy machine. Targets: <= 20,000 (flash-25m, 32 x 128) and <= 4,000
(the study model, 8 x 128).

    python -m benchmarks.bench_ops

For the breakdown by op and input shape use `python -m benchmarks.profile_step --model study --by-shape`.
"""

from __future__ import annotations

import argparse
import resource
from typing import Any

from benchmarks.profile_step import MODELS, profile_step

TARGETS = {"flash-25m": 20_000, "study": 4_000}


def run(quick: bool = False) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for name in MODELS:
        _, counts = profile_step(name)
        res[name] = {**counts, "target": TARGETS[name],
                     "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    print(f"{'model':<12}{'forward':>9}{'backward':>10}{'optimizer':>11}{'total':>8}{'target':>8}{'RSS MB':>8}")
    for name, r in res.items():
        print(f"{name:<12}{r['forward']:>9}{r['backward']:>10}{r['optimizer']:>11}{r['total']:>8}{r['target']:>8}"
              f"{r['peak_rss_mb']:>8.0f}")
    return res


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__).parse_args()
    run()
