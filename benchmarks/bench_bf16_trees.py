"""bf16-mixed against fp32 training of flash-25m (32 x 128, fwd + bwd + the stages' AdamW), in this tree and an older
commit, step by step in one sitting: each tree runs in its own long-lived worker process (the old one exported with
``git archive``, as benchmarks/bench_vs_commit.py does), and the workers take turns, one untimed and one timed step per
tree and precision per round, so that a shared machine's load hits all four rows alike. Each step is timed in the
worker's CPU time (``time.process_time``) and in wall time. Reported per tree: the median and the fastest step of
each precision and the bf16 / fp32 throughput ratio (of the medians, of the fastest steps, and per round). The
fastest step is the one least slowed by other processes: on this 2-vCPU machine a step's CPU time itself grew by up to
1.5x while another process ran on the other vCPU (which shares the core's caches and, if a hyperthread, its units).

    python -m benchmarks.bench_bf16_trees [--rev f645ffb] [--rounds 5] [--batch 32]

On a CPU without native bf16 (no avx512_bf16 / amx_bf16) bf16 runs its emulated GEMMs (mixed_precision.py): the
ratio then measures the emulation, not bf16.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.bench_vs_commit import ROOT, export

BASE_REV = "f645ffb"
"""main before issue 49 part 6's bf16 work (fp32 attention under bf16, bf16 MoE ops)."""

WORKER = r"""
import sys, time, torch
from contextlib import nullcontext
import torch.nn.functional as F
from glm_lightning.model import GLMConfig, GLMModel
from glm_lightning.optim import AdamW
torch.set_num_threads(int(sys.argv[1]))
torch.manual_seed(0)
model = GLMModel(GLMConfig.preset("flash-25m"))
opt = AdamW(model.parameters(), lr=1e-4)
ids = torch.randint(0, 256, (int(sys.argv[2]), 129), generator=torch.Generator().manual_seed(0))
print("ready", flush=True)
for line in sys.stdin:
    t, w = time.process_time(), time.perf_counter()
    with torch.autocast("cpu", torch.bfloat16) if line.strip() == "bf16" else nullcontext():
        out = model(ids[:, :-1])
        loss = F.cross_entropy(out.logits.float().flatten(0, 1), ids[:, 1:].flatten()) + out.aux_loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(time.process_time() - t, time.perf_counter() - w, flush=True)
"""

MODES = ("fp32", "bf16")


def start(tree: Path, threads: int, batch: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(threads), str(batch)], cwd=tree, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def step(proc: subprocess.Popen, mode: str) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one step in ``mode``."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(mode + "\n")
    proc.stdin.flush()
    cpu, wall = proc.stdout.readline().split()
    return float(cpu), float(wall)


def run(rev: str = BASE_REV, rounds: int = 5, batch: int = 32) -> dict[str, Any]:
    import torch

    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        export(rev, Path(tmp))
        workers = {"new": start(ROOT, threads, batch), rev: start(Path(tmp), threads, batch)}
        times: dict[tuple[str, str], list[tuple[float, float]]] = {(t, m): [] for t in workers for m in MODES}
        try:
            for _ in range(rounds):
                for name, proc in workers.items():
                    for mode in MODES:
                        step(proc, mode)
                        times[(name, mode)].append(step(proc, mode))
        finally:
            for proc in workers.values():
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait()
    res: dict[str, Any] = {"rev": rev, "threads": threads, "rounds": rounds, "batch": batch, "trees": {}}
    print(f"flash-25m {batch} x 128 fwd + bwd + AdamW, {threads} thread(s), {rounds} rounds, trees and precisions "
          f"taking turns step by step; median seconds per step")
    print(f"{'tree':<10}{'fp32 cpu':>10}{'bf16 cpu':>10}{'fp32 wall':>11}{'bf16 wall':>11}{'bf16/fp32':>11}"
          f"{'fp32 best':>11}{'bf16 best':>11}{'ratio':>7}  per round (cpu)")
    for name in workers:
        med = {m: [statistics.median(x[i] for x in times[(name, m)]) for i in (0, 1)] for m in MODES}
        per_round = [f[0] / b[0] for f, b in zip(times[(name, "fp32")], times[(name, "bf16")])]
        best = {m: min(x[0] for x in times[(name, m)]) for m in MODES}
        ratio = med["fp32"][0] / med["bf16"][0]
        res["trees"][name] = {"fp32_cpu_s": med["fp32"][0], "bf16_cpu_s": med["bf16"][0], "fp32_wall_s": med["fp32"][1],
                              "bf16_wall_s": med["bf16"][1], "bf16_over_fp32": ratio, "per_round": per_round,
                              "fp32_best_cpu_s": best["fp32"], "bf16_best_cpu_s": best["bf16"],
                              "bf16_over_fp32_best": best["fp32"] / best["bf16"]}
        print(f"{name:<10}{med['fp32'][0]:>10.2f}{med['bf16'][0]:>10.2f}{med['fp32'][1]:>11.2f}{med['bf16'][1]:>11.2f}"
              f"{ratio:>10.2f}x{best['fp32']:>11.2f}{best['bf16']:>11.2f}{best['fp32'] / best['bf16']:>6.2f}x  "
              f"{', '.join(f'{r:.2f}' for r in per_round)}")
    return res


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rev", default=BASE_REV)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    a = p.parse_args()
    run(rev=a.rev, rounds=a.rounds, batch=a.batch)
