"""Dev pass per family against wall-clock minutes, one panel per seed, from `configs/pretrain.yaml` runs; prints the
markdown table of docs/results/pretrain.md.

    PYTHONPATH=. python docs/results/pretrain_plot.py docs/results/pretrain.png [LABEL=]RUN_DIR [...]

RUN_DIR is a TensorBoard run directory (e.g. lightning_logs/pretrain/version_0), LABEL its name in the plot. The x axis is `time/train_minutes`
(fit wall minutes, logged after each validation's dev evaluation), so evaluation time counts against the budget.
"""
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from glm_lightning.sweep.events import read_scalars

out = Path(sys.argv[1])
labelled = [a.split("=", 1) if "=" in a else (Path(a).parent.name + "/" + Path(a).name, a) for a in sys.argv[2:]]
labels, runs = [lab for lab, _ in labelled], [Path(p) for _, p in labelled]
fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.6), sharey=True, squeeze=False)
print("| run | step | wall min | dev pass | families all-pass | families > half | per family |")
print("|---|---:|---:|---:|---:|---:|---|")
for ax, label, run in zip(axes[0], labels, runs):
    s = read_scalars(run)
    minutes = dict(s["time/train_minutes"])
    families = sorted(t.split("/")[-1] for t in s if t.startswith("val/dev_pass/"))
    for i, fam in enumerate(families):
        pts = [(minutes[step], 100 * v) for step, v in s[f"val/dev_pass/{fam}"] if step in minutes]
        ax.plot(*zip(*pts), marker="o", ms=3, lw=1.2, color=f"C{i}", label=fam)
    total = [(minutes[step], 100 * v) for step, v in s["val/dev_pass"] if step in minutes]
    ax.plot(*zip(*total), color="black", lw=2.2, label="all")
    ax.axvline(20, color="gray", ls="--", lw=1)
    ax.set_title(label, fontsize=9)
    ax.set_xlabel("wall-clock minutes in fit")
    solved, majority = dict(s["val/families_solved"]), dict(s["val/families_majority"])
    for step, v in s["val/dev_pass"]:
        per = " ".join(f"{fam[:4]} {100 * dict(s[f'val/dev_pass/{fam}'])[step]:.0f}" for fam in families)
        print(f"| {label} | {step + 1} | {minutes.get(step, float('nan')):.1f} | {100 * v:.1f} "
              f"| {solved[step]:.0f}/8 | {majority[step]:.0f}/8 | {per} |")
print()
print("| run | first eval with >= 7/8 families > half pass | first eval with >= 7/8 families all-pass "
      "| at the end: dev pass, families all-pass | fit wall min |")
print("|---|---|---|---|---:|")
for label, run in zip(labels, runs):
    s = read_scalars(run)
    minutes = dict(s["time/train_minutes"])
    solved, majority, dev = dict(s["val/families_solved"]), dict(s["val/families_majority"]), dict(s["val/dev_pass"])

    def first(counts: dict[int, float]) -> str:
        hit = [step for step in sorted(counts) if counts[step] >= 7]
        return f"step {hit[0] + 1}, {minutes[hit[0]]:.1f} min" if hit else "never"
    last = max(dev)
    print(f"| {label} | {first(majority)} | {first(solved)} | {100 * dev[last]:.1f}%, {solved[last]:.0f}/8 "
          f"| {minutes[last]:.1f} |")
axes[0][0].set_ylabel("greedy dev pass (%)")
axes[0][-1].legend(fontsize=7, loc="lower right")
fig.tight_layout()
fig.savefig(out, dpi=110)
