"""`make bench`: every benchmark, each in its own process (so peak RSS is per benchmark), one summary table,
numbers saved to benchmarks/results/latest.json.

    python -m benchmarks [--quick] [--threads 2] [--only train,generation,verifier]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BENCHES = ("train", "generation", "verifier")

CHILD = """
import json, sys, importlib, torch
name, quick, threads, out = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(threads)
res = importlib.import_module(f"benchmarks.bench_{name}").run(quick=quick)
json.dump(res, open(out, "w"), default=str)
"""


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
                                   f"{g['naive_tokens_per_s']:.0f} tok/s, {g['speedup']:.1f}x, "
                                   f"RSS {g['peak_rss_mb']:.0f} MB", "cached >= 10x naive"))
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
    p.add_argument("--threads", type=int, default=2, help="torch threads (use 1 on a machine busy with other work)")
    args = p.parse_args()
    results, failed = {}, []
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    for name in args.only.split(","):
        print(f"\n=== {name} ===", flush=True)
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            rc = subprocess.run([sys.executable, "-c", CHILD, name, "1" if args.quick else "0", str(args.threads),
                                 f.name], env=env).returncode
            if rc != 0:
                failed.append(name)
                continue
            results[name] = json.load(open(f.name))
    print("\n=== summary ===")
    print(f"{'benchmark':<12}{'result':<64}{'target'}")
    for row in summary_rows(results):
        print(f"{row[0]:<12}{row[1]:<64}{row[2]}")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "latest.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"saved {out / 'latest.json'}")
    if failed:
        sys.exit(f"benchmarks failed: {failed}")


if __name__ == "__main__":
    main()
