"""Generation's prefill: one cached forward over the prompt(s), as generation.generate runs it, in CPU time.

flash-25m (fresh weights, seed 0), one thread: the prefill that ``generate(model, prompt, num_samples=16)`` runs over
one prompt of 16, 44 and 64 tokens (``model(ids, valid=valid, cache=decode_cache(...))``, no autograd), and the greedy
batch decode's prefill over 16 distinct prompts of 20-40 tokens left-padded to 40 (evaluation.sample_completions).
Each case is timed in the process's CPU time (``time.process_time``: on a shared machine wall time also counts what
the scheduler gave to others), the cases in turns, medians of the rounds.

``--rev COMMIT`` also runs that commit's tree (``git archive`` into a temporary folder, its own C++ library), each tree
in its own long-lived worker process, the two taking turns case by case in alternating order, so that load changes hit
both alike; it prints both medians, their ratio, the median and quartiles of the rounds' paired ratios (the two trees' calls of a
round ran back to back), and how far the two trees' last-position logits lie apart.

    python -m benchmarks.bench_prefill [--rev HEAD~1] [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = ("1x16", "1x44", "1x64", "16x40pad")

WORKER = r'''
import json, os, sys, time, torch
torch.set_num_threads(1)
from glm_lightning import generation as G
from glm_lightning.model import GLMConfig, GLMModel
torch.manual_seed(0)
model = GLMModel(GLMConfig.preset("flash-25m")).eval()
gen = torch.Generator().manual_seed(1)
def prompt(b, t, padded):
    ids = torch.randint(0, 256, (b, t), generator=gen)
    valid = torch.ones(b, t, dtype=torch.bool)
    if padded:  # left padding: lengths 20 .. t
        for row, n in enumerate(torch.randint(20, t + 1, (b,), generator=gen).tolist()):
            valid[row, : t - n] = False
    return ids, valid
cases = {"1x16": prompt(1, 16, False), "1x44": prompt(1, 44, False), "1x64": prompt(1, 64, False),
         "16x40pad": prompt(16, 40, True)}
def prefill(name):
    ids, valid = cases[name]
    with torch.inference_mode():
        cache = G.decode_cache(model, ids.shape[0], ids.shape[1] + 48)
        t, c = time.perf_counter(), time.process_time()
        logits = model(ids, valid=valid, cache=cache).logits[:, -1]
        return logits, time.process_time() - c, time.perf_counter() - t
for name in cases:
    prefill(name)  # warm-up (builds or loads the tree's C++ library)
print("ready", flush=True)
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "dump":
        torch.save({name: prefill(name)[0] for name in cases}, arg)
        print("[]", flush=True)
    else:
        _, cpu, wall = prefill(cmd)
        print(json.dumps([cpu, wall]), flush=True)
'''


class Worker:
    """One tree's worker process: runs a case per request and answers its CPU and wall seconds."""

    def __init__(self, tree: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER], cwd=tree, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"the worker of {tree} failed to start")

    def ask(self, line: str) -> list[float]:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def export(rev: str, into: Path) -> Path:
    """The tree of commit `rev` written under `into` (git archive)."""
    archive = into / "tree.tar"
    with archive.open("wb") as f:
        subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, stdout=f)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "tree", filter="data")
    return into / "tree"


def logit_gap(workers: dict[str, Worker], tmp: Path) -> dict[str, float]:
    """Per case, the largest |difference| between the trees' last-position logits."""
    import torch  # only here: the parent process needs no model

    dumps = {}
    for name, w in workers.items():
        w.ask(f"dump {tmp / name}.pt")
        dumps[name] = torch.load(tmp / f"{name}.pt")
    a, b = dumps.values()
    return {case: float((a[case] - b[case]).abs().max()) for case in CASES}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", help="also run this commit's tree, in turns with this one")
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        trees = {"this": ROOT} | ({args.rev: export(args.rev, tmp)} if args.rev else {})
        workers = {name: Worker(tree) for name, tree in trees.items()}
        try:
            cpu: dict[str, dict[str, list[float]]] = {n: {c: [] for c in CASES} for n in trees}
            for r in range(args.rounds):
                for case in CASES:
                    for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                        cpu[name][case].append(workers[name].ask(case)[0])
                print(f"round {r} (load {os.getloadavg()[0]:.1f}): " + ", ".join(
                    f"{case} " + "/".join(f"{1e3 * cpu[n][case][-1]:.1f}" for n in trees) for case in CASES),
                    flush=True)
            gap = logit_gap(workers, tmp) if args.rev else {}
        finally:
            for w in workers.values():
                w.close()
    print(f"\nprefill, flash-25m, CPU ms per call (median of {args.rounds} rounds), 1 thread, "
          f"{_cpu_name()}; trees: " + ", ".join(trees))
    head = f"{'case':14s}" + "".join(f"{n[:12]:>14s}" for n in trees)
    print(head + (f"{'ratio':>8s}{'per round':>18s}{'max |dlogit|':>14s}" if args.rev else ""))
    for case in CASES:
        med = [statistics.median(cpu[n][case]) for n in trees]
        row = f"{case:14s}" + "".join(f"{1e3 * m:14.2f}" for m in med)
        if args.rev:  # the other tree's time over this one's: medians, and each round's pair (quartiles)
            pairs = sorted(o / t for t, o in zip(*(cpu[n][case] for n in trees)))
            q = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else pairs * 3
            row += f"{med[1] / med[0]:7.2f}x  {q[1]:.2f}x ({q[0]:.2f}-{q[2]:.2f}){gap[case]:12.2e}"
        print(row)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    main()
