"""Cached generation of this tree against another checkout of the project, taking turns in one run.

flash-25m, 16 samples x 48 new tokens after a 64-token prompt (as bench_generation), one thread: each tree runs in its
own long-lived worker process (its own sources on PYTHONPATH, its own C++ library), and the two take turns, one
generate call each per round, in alternating order, so that load changes on a shared machine hit both alike. Reported
per round and as medians: tokens/s of wall time and per CPU second of the worker (on a machine shared with processes
of the same priority, wall time also counts what the scheduler gave to others), and the ratios.

    python -m benchmarks.bench_generation_trees /path/to/other/checkout [--rounds 6] [--precision bf16]

``--precision bf16`` samples from generation.sampling_weights' bf16 copy (bf16 panels) in both trees.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKENS = 16 * 48

WORKER = r'''
import json, sys, time, torch
torch.set_num_threads(1)
from glm_lightning.generation import generate
from glm_lightning.model import GLMConfig, GLMModel
torch.manual_seed(0)
model = GLMModel(GLMConfig.preset("flash-25m")).eval()
prompt = torch.randint(0, 256, (1, 64))
def run():
    generate(model, prompt, max_new_tokens=48, num_samples=16, temperature=1.0, eos_id=None,
             generator=torch.Generator().manual_seed(0), precision=sys.argv[1])
run()  # warm-up (builds or loads the tree's C++ library)
print("ready", flush=True)
for _ in sys.stdin:
    t, c = time.perf_counter(), time.process_time()
    run()
    print(json.dumps([time.perf_counter() - t, time.process_time() - c]), flush=True)
'''


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("other", type=Path, help="the other checkout's root (its glm_lightning/ is imported from there)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--precision", default="32", choices=("32", "bf16"), help="bf16: generation's bf16 sampling copy")
    args = p.parse_args()
    trees = {"other": args.other.resolve(), "this": ROOT}
    procs = {name: subprocess.Popen([sys.executable, "-c", WORKER, args.precision], cwd=tree, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(tree)})
             for name, tree in trees.items()}
    try:
        for proc in procs.values():
            if proc.stdout.readline().strip() != "ready":
                raise SystemExit("a worker failed to start")
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
        for r in range(args.rounds):
            for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                procs[name].stdin.write("go\n")
                procs[name].stdin.flush()
                times[name].append(tuple(json.loads(procs[name].stdout.readline())))
            print(f"round {r} (load {os.getloadavg()[0]:.1f}): " + ", ".join(
                f"{name} {TOKENS / times[name][-1][0]:.0f} tok/s ({TOKENS / times[name][-1][1]:.0f} per CPU s)"
                for name in trees), flush=True)
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()
    print(f"cached generation, flash-25m, 16 x 48, precision {args.precision}, 1 thread; this = {ROOT}, "
          f"other = {trees['other']}")
    for name in trees:
        print(f"{name:6s} median {TOKENS / statistics.median(t[0] for t in times[name]):5.0f} tok/s, "
              f"{TOKENS / statistics.median(t[1] for t in times[name]):5.0f} per CPU second")
    pairs = list(zip(times["other"], times["this"]))
    print("this / other per round: wall " + ", ".join(f"{o[0] / t[0]:.2f}x" for o, t in pairs)
          + "; CPU " + ", ".join(f"{o[1] / t[1]:.2f}x" for o, t in pairs))


if __name__ == "__main__":
    main()
