"""Study-model training steps/s of this tree vs a previous commit, alternated in one run.

The old commit is exported to a temporary directory (`git archive`, nothing is added to the repository's worktree
list) and each tree runs in its own long-lived worker process; the two workers take turns, a few steps each, so that
load changes on a shared machine hit both alike. Reported: the median seconds per step of each and the ratio.

A step is the model's forward, loss, backward and the optimizer step of the tree's training stages
(glm_lightning/modules/base.py builds glm_lightning.optim.AdamW where the tree has it; 11d912b built torch's default
AdamW), so the ratio is what a study run feels. `--same-optimizer` gives both trees torch's default AdamW instead,
which measures the model alone.

    python -m benchmarks.bench_vs_commit [--rev 11d912b] [--rounds 6] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BASE_REV = "11d912b"
"""main before the speed work (docs/performance.md)."""

WORKER = r"""
import sys, time, resource, torch
import torch.nn.functional as F
from glm_lightning.model import GLMConfig, GLMModel
torch.set_num_threads(int(sys.argv[1]))
torch.manual_seed(0)
cfg = GLMConfig.preset("tiny", d_model=48, n_layers=3, n_heads=3, n_kv_heads=3, head_dim=16, max_seq_len=128,
                       expert_hidden=96, shared_expert_hidden=96)
model = GLMModel(cfg)
from torch.optim import AdamW
if sys.argv[2] == "stage":
    try:  # the tree's training stages' optimizer: glm_lightning.optim.AdamW where it exists (fused, shared counters)
        from glm_lightning.optim import AdamW
    except ImportError:  # else torch's default AdamW, which the stages of older trees built
        pass
opt = AdamW(model.parameters(), lr=1e-4)
ids = torch.randint(0, 256, (8, 129), generator=torch.Generator().manual_seed(0))
def step():
    out = model(ids[:, :-1])
    loss = F.cross_entropy(out.logits.flatten(0, 1), ids[:, 1:].flatten()) + out.aux_loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
step()
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    t = time.perf_counter()
    for _ in range(n):
        step()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print((time.perf_counter() - t) / n, rss, flush=True)
"""


def export(rev: str, dest: Path, root: Path = ROOT) -> None:
    """The tree of `rev` (its Python sources) written under dest; without the repository's git history (a copy
    without `.git`, no `git`, an unknown revision) a one-line error says so."""
    try:
        done = subprocess.run(["git", "archive", "--format=tar", rev, "glm_lightning"], cwd=root,
                              capture_output=True)
    except FileNotFoundError:
        raise SystemExit("error: bench_vs_commit needs `git` to export the old tree; install git") from None
    if done.returncode != 0:
        why = (done.stderr.decode(errors="replace").strip().splitlines() or ["git archive failed"])[-1]
        raise SystemExit(f"error: bench_vs_commit needs the git history of {root} to export {rev} ({why}); run it "
                         "in a clone, not in a copy without .git")
    data = done.stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")


def start(tree: Path, threads: int, optimizer: str = "stage") -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(threads), optimizer], cwd=tree, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def ask(proc: subprocess.Popen, steps: int) -> tuple[float, float]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"{steps}\n")
    proc.stdin.flush()
    sec, rss = proc.stdout.readline().split()
    return float(sec), float(rss)


def run(quick: bool = False, rev: str = BASE_REV, rounds: int = 6, steps: int = 5,
        same_optimizer: bool = False) -> dict[str, Any]:
    import torch

    threads = torch.get_num_threads()
    if quick:
        rounds, steps = 3, 3
    with tempfile.TemporaryDirectory() as tmp:
        export(rev, Path(tmp))
        optimizer = "torch" if same_optimizer else "stage"
        workers = {"new": start(ROOT, threads, optimizer), rev: start(Path(tmp), threads, optimizer)}
        times: dict[str, list[float]] = {k: [] for k in workers}
        rss: dict[str, float] = {}
        try:
            for _ in range(rounds):
                for name, proc in workers.items():
                    sec, rss[name] = ask(proc, steps)
                    times[name].append(sec)
        finally:
            for proc in workers.values():
                proc.stdin.close()
                proc.wait()
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    res = {"rev": rev, "threads": threads, "rounds": rounds, "steps_per_round": steps, "optimizer": optimizer,
           "new_steps_per_s": 1 / med["new"], "old_steps_per_s": 1 / med[rev], "speedup": med[rev] / med["new"],
           "peak_rss_mb_new": rss["new"], "peak_rss_mb_old": rss[rev],
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    opt_name = "torch's AdamW in both" if same_optimizer else "each tree's stage optimizer"
    print(f"study model (tiny widened, 8 x 128) training steps/s, {threads} thread(s), {rounds} alternated rounds "
          f"of {steps} steps, {opt_name}")
    print(f"{'tree':<10}{'steps/s':>9}{'RSS MB':>8}")
    print(f"{'new':<10}{res['new_steps_per_s']:>9.2f}{rss['new']:>8.0f}")
    print(f"{rev:<10}{res['old_steps_per_s']:>9.2f}{rss[rev]:>8.0f}")
    print(f"new / {rev}: {res['speedup']:.2f}x")
    return res


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rev", default=BASE_REV)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--same-optimizer", action="store_true", help="torch's default AdamW in both trees (the model alone)")
    a = p.parse_args()
    run(rev=a.rev, rounds=a.rounds, steps=a.steps, same_optimizer=a.same_optimizer)
