"""`make bench`: every benchmark, each in its own process (so peak RSS is per benchmark), one summary table,
numbers saved to benchmarks/results/latest.json.

    python -m benchmarks [--quick] [--only train,generation,verifier]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
from pathlib import Path

BENCHES = ("train", "generation", "verifier")


def _worker(name: str, quick: bool, queue: mp.Queue) -> None:
    import importlib

    import torch

    torch.set_num_threads(2)
    queue.put(importlib.import_module(f"benchmarks.bench_{name}").run(quick=quick))


def summary_rows(results: dict) -> list[tuple[str, str, str]]:
    rows = []
    if "train" in results:
        t, h = results["train"], results["train"]["hybrid flash-25m"]
        rows.append(("train", f"{h['tokens_per_s']:.0f} tok/s, MFU {h['mfu']:.1%}, "
                              f"hybrid/dense {t['hybrid_over_dense']:.2f}x, RSS {t['peak_rss_mb']:.0f} MB",
                     "MFU >= 25%, hybrid/dense >= 0.6x"))
    if "generation" in results:
        g = results["generation"]
        rows.append(("generation", f"cached {g['cached_tokens_per_s']:.0f} tok/s, naive "
                                   f"{g['naive_tokens_per_s']:.0f} tok/s, {g['speedup']:.1f}x", "cached >= 10x naive"))
    if "verifier" in results:
        v = results["verifier"]
        rows.append(("verifier", f"batched {v['check_many']['verdicts_per_s']:.0f} verdicts/s, "
                                 f"{v['ratio_batched_over_baseline']:.1f}x the subprocess baseline",
                     ">= 200 verdicts/s batched"))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.add_argument("--only", default=",".join(BENCHES))
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    results = {}
    for name in args.only.split(","):
        print(f"\n=== {name} ===", flush=True)
        q = ctx.Queue()
        proc = ctx.Process(target=_worker, args=(name, args.quick, q))
        proc.start()
        results[name] = q.get()
        proc.join()
    print("\n=== summary ===")
    print(f"{'benchmark':<12}{'result':<56}{'target'}")
    for row in summary_rows(results):
        print(f"{row[0]:<12}{row[1]:<56}{row[2]}")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "latest.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"saved {out / 'latest.json'}")


if __name__ == "__main__":
    main()
