"""Digit accuracy vs text dev pass, one point per method and seed, from a vision_forgetting sweep's runs.

    PYTHONPATH=. python docs/results/vision_forgetting_plot.py runs/sweeps/vision_forgetting \
        docs/results/vision_forgetting.png <text pass before, %> [title]
"""
import sys
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

from glm_lightning.sweep.events import read_scalars

root, out, baseline = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
fig, ax = plt.subplots(figsize=(6, 4.2))
rows = []
for i, method in enumerate(sorted(p.name for p in root.iterdir() if p.is_dir())):
    for run in sorted((root / method).glob("seed*")):
        s = read_scalars(run)
        if "val/acc" not in s or "text/greedy_pass" not in s:
            continue
        acc, text = 100 * s["val/acc"][-1][1], 100 * s["text/greedy_pass"][-1][1]
        rows.append((method, run.name, acc, text))
        ax.scatter(acc, text, color=f"C{i}", label=method if run.name == "seed0" else None, s=40)
ax.axhline(baseline, color="gray", ls="--", lw=1, label=f"text before ({baseline:.1f}%)")
ax.axhline(baseline - 2, color="gray", ls=":", lw=1, label="-2 points")
ax.set_xlabel("digit val accuracy (%)")
ax.set_ylabel("text dev pass (%, 64 tasks)")
ax.legend(fontsize=7, loc="best")
if len(sys.argv) > 4:
    ax.set_title(sys.argv[4], fontsize=9)
fig.tight_layout()
fig.savefig(out, dpi=110)
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} |")
