"""What each part buys: quality against training wall-clock per arm of the ablation studies, one point per seed, and
the learning curves of the 150-step arms; prints the markdown table of docs/results/ablations.md.

    PYTHONPATH=. python docs/results/ablation_plot.py docs/results/ablations.png [ablation_moe ...] [--runs runs/sweeps]

Minutes are training minutes: an arm's optimizer steps times its measured seconds per step
(docs/results/data/ablation_step_times.json, `python -m benchmarks.bench_ablation_steps --write`: one thread, the arms
taking turns, nothing else running), so the runs' evaluation time and the sweep's two parallel workers do not enter.
Final values and the curves (the evaluations during training) come from the sweep's runs (`--runs`: their DONE.json
and TensorBoard events) or else the committed docs/results/data/<study>.json (`sweep findings` saves both there; the
MoE and indexer studies were saved before it kept curves, so they are drawn as points only).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.bench_ablation_steps import EQUAL_TIME_SUFFIX, RESULTS, variant_steps  # noqa: E402
from glm_lightning.sweep.events import read_scalars  # noqa: E402
from glm_lightning.sweep.study import REPO_ROOT, load_study  # noqa: E402

PANELS = (("val/dev_pass", "dev pass (points, 96 tasks)", 100.0), ("val/bpb", "val bits per byte", 1.0))


def final_values(study_name: str, runs_root: Path) -> list[dict]:
    """[{variant, seed, final, dir | curves}] of every finished run of the study: the sweep's folder, else the
    committed data."""
    folder = runs_root / study_name
    found = []
    for done in sorted(folder.glob("*/seed*/DONE.json")):
        rec = json.loads(done.read_text())
        found.append({"variant": done.parent.parent.name, "seed": int(done.parent.name[4:]),
                      "final": rec.get("final", {}), "dir": done.parent})
    if found:
        return found
    data = REPO_ROOT / "docs" / "results" / "data" / f"{study_name}.json"
    return json.loads(data.read_text())["runs"] if data.is_file() else []


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("studies", nargs="*", default=["ablation_mhc", "ablation_mhc_2streams", "ablation_mixer", "ablation_moe",
                                                      "ablation_indexer", "ablation_moe_25m", "ablation_mixer_25m",
                                                      "ablation_mixer_avx512"])
    p.add_argument("--runs", default="runs/sweeps")
    args = p.parse_args(argv)
    times = json.loads(RESULTS.read_text())["by_variant"]
    studies = [(s, load_study(REPO_ROOT / "configs" / "experiments" / f"{s}.yaml")) for s in args.studies]
    studies = [(s, st, final_values(s, Path(args.runs))) for s, st in studies]
    studies = [x for x in studies if x[2]]
    if not studies:
        raise SystemExit("no finished runs of these studies (run their sweeps first)")
    fig, axes = plt.subplots(len(PANELS), len(studies), figsize=(4.6 * len(studies), 7.0), squeeze=False)
    print("| study | arm | steps | s/step | training minutes | seeds | dev pass (mean) | val bpb (mean) | "
          "held-out families (mean) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for col, (name, study, runs) in enumerate(studies):
        short = name.removeprefix("ablation_")
        control_steps = variant_steps(study, study.variant(study.control))
        for i, variant in enumerate(study.variants):
            mine = [r for r in runs if r["variant"] == variant.name]
            if not mine:
                continue
            base = variant.name.removesuffix(EQUAL_TIME_SUFFIX)
            steps = variant_steps(study, variant)
            s_per_step = times[f"{short}/{base}"]["seconds_per_step"]
            minutes = steps * s_per_step / 60
            color = f"C{[v.name.removesuffix(EQUAL_TIME_SUFFIX) for v in study.variants].index(base)}"
            marker = "s" if variant.name.endswith(EQUAL_TIME_SUFFIX) else "o"
            for row, (tag, label, scale) in enumerate(PANELS):
                ax = axes[row][col]
                ys = [scale * r["final"][tag] for r in mine if tag in r["final"]]
                ax.scatter([minutes] * len(ys), ys, color=color, marker=marker, alpha=0.6, s=18,
                           label=f"{variant.name} ({steps} steps)")
                if steps == control_steps:  # the learning curve at equal steps: mean over seeds at each evaluation
                    curve = _mean_curve(mine, tag, s_per_step, scale)
                    if curve:
                        ax.plot(*zip(*curve), color=color, lw=1.2, alpha=0.8)
                ax.set_xlabel("training minutes (steps x measured s/step)")
                ax.set_ylabel(label)
                cpu = times[f"{short}/{study.control}"].get("torch_cpu")  # minutes are per CPU: name it
                ax.set_title(f"{name} ({cpu} CPU)" if cpu else name, fontsize=10)
            means = [statistics.fmean(r["final"][t] for r in mine if t in r["final"]) if any(
                t in r["final"] for r in mine) else float("nan") for t in ("val/dev_pass", "val/bpb",
                                                                             "val/heldout_pass")]
            print(f"| {short} | {variant.name} | {steps} | {s_per_step:.3f} | {minutes:.2f} | {len(mine)} | "
                  f"{100 * means[0]:.1f} | {means[1]:.4f} | {100 * means[2]:.1f} |")
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"\nwrote {args.out}")


def _mean_curve(runs: list[dict], tag: str, s_per_step: float, scale: float) -> list[tuple[float, float]]:
    """Mean over seeds of `tag` at each evaluated step, at (step x s/step) minutes; empty where a run has no curve
    (neither events nor a saved curve)."""
    by_step: dict[int, list[float]] = {}
    for run in runs:
        points = read_scalars(Path(run["dir"])).get(tag, []) if run.get("dir") else run.get("curves", {}).get(tag, [])
        if not points:
            return []
        for step, value in points:
            by_step.setdefault(step + 1, []).append(scale * value)
    return [(step * s_per_step / 60, statistics.fmean(v)) for step, v in sorted(by_step.items())]


if __name__ == "__main__":
    main()
