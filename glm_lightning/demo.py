"""`make demo`: the whole product on embedded defaults, no network; each stage's checkpoint feeds the next.

    stage 1  pre-training   a small model learns the classic function families (configs/demo/pretrain.yaml)
    stage 2  vision         digit images for that model: encoder + image-token adapters, every LM weight frozen
                            (configs/demo/vision.yaml);
                            afterwards the text dev pass is measured again (did vision fine-tuning cost text skill?)
    stage 3  RL             GRPO-family RL on executable tasks from the stage-2 weights (configs/demo/rl.yaml):
                            pass@1 / pass@8 / greedy on the confirm split before and after, regression verdicts
                            for the monitored families
    summary  one table, plus the TensorBoard command

`--smoke` shrinks every stage to a few steps (used by the tests) and keeps everything it writes under
lightning_logs/smoke/, so it never replaces a real run's checkpoints (lightning_logs/demo/*.ckpt, which the RL studies
load). `--dry-run` checks every stage config (keys, values, preflight checks) and prints the stage commands, writing
nothing. `--max-steps N` only shortens pre-training.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# torch, Lightning and the stage CLI are imported where a stage runs, so `demo --help` and the run's first line
# come before the seconds those imports take

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
STAGE_CONFIGS = {"pretrain": ("pretrain.yaml", "demo/pretrain.yaml"), "vision": ("vision.yaml", "demo/vision.yaml"),
                 "rl": ("rl.yaml", "demo/rl.yaml")}
"""Each demo stage: the stage config plus the demo overlay holding only the differences (the `demo` model preset,
shorter runs, the demo's families)."""
ROOT = Path("lightning_logs")
SMOKE_ROOT = ROOT / "smoke"
"""Where each demo run writes (logs, checkpoints, stable copies): `--smoke` runs never touch a real run's files."""
STABLE = ROOT / "demo"
"""Each stage's final checkpoint is also copied here as pretrain.ckpt / vision.ckpt / rl.ckpt (stable names that
the RL studies in configs/experiments/ start from); a smoke run's copies go to lightning_logs/smoke/demo/."""

SMOKE = {
    "pretrain": ["--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--data.init_args.num_examples",
                 "64", "--data.init_args.dev_per_family", "1", "--data.init_args.val_per_family", "1"],
    "vision": ["--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
               "--trainer.limit_test_batches", "1"],
    "rl": ["--trainer.max_steps", "1", "--data.init_args.prompts_per_family", "2", "--data.init_args.eval_per_family",
           "1", "--model.init_args.sampling.group_size", "2", "--model.init_args.sampling.max_new_tokens", "8"],
}


@dataclass
class StageResult:
    name: str
    seconds: float = 0.0
    checkpoint: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def _scalars(results: list[dict[str, Any]] | dict[str, Any]) -> dict[str, float]:
    rows = results if isinstance(results, list) else [results]
    out: dict[str, float] = {}
    for row in rows:
        for k, v in row.items():
            out[k] = float(v)
    return out


def stage_args(stage: str, extra: list[str]) -> list[str]:
    """The stage CLI arguments: the stage config, the demo overlay, then the run's own arguments."""
    return [*(arg for name in STAGE_CONFIGS[stage] for arg in ("--config", str(CONFIGS / name))), *extra]


def _cli(stage: str, extra: list[str]) -> Any:
    from glm_lightning.stage_cli import build_cli

    return build_cli(stage_args(stage, extra), run=False)


def _last_checkpoint(trainer: Any) -> str | None:
    """The run's always-current last.ckpt (written at the end of training by `LastCheckpoint`)."""
    from callbacks.last_checkpoint import LastCheckpoint

    cb = next((c for c in trainer.callbacks if isinstance(c, LastCheckpoint)), None)
    return str(cb.last_path) if cb is not None and cb.last_path is not None else None


def root_args(root: Path, stage: str) -> list[str]:
    """Send a stage's logs and checkpoints under `root` (the smoke run's own folder, or lightning_logs)."""
    return ["--trainer.logger.init_args.save_dir", str(root), "--trainer.default_root_dir", str(root / stage)]


def pretrain(extra: list[str]) -> StageResult:
    t = time.perf_counter()
    cli = _cli("pretrain", extra)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    res = StageResult("pre-training", checkpoint=_last_checkpoint(cli.trainer))
    res.metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items() if k.startswith("val/")}
    res.seconds = time.perf_counter() - t
    return res


def text_dev_pass(checkpoint: str, extra: list[str]) -> dict[str, float]:
    """Greedy dev pass of any stage's checkpoint, measured by the pre-training module's own validation."""
    cli = _cli("pretrain", [*extra, "--model.init_args.init_weights", checkpoint, "--trainer.logger", "false",
                                 "--trainer.callbacks", "[]", "--trainer.enable_progress_bar", "false"])
    metrics = _scalars(cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False))
    return {k: v for k, v in metrics.items() if k.startswith("val/dev_pass")}


def vision(checkpoint: str, extra: list[str], pretrain_extra: list[str]) -> StageResult:
    t = time.perf_counter()
    cli = _cli("vision", [*extra, "--model.init_args.init_weights", checkpoint])
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    test = _scalars(cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False))
    res = StageResult("vision", checkpoint=_last_checkpoint(cli.trainer), metrics=test)
    res.extra["text_dev_pass_after"] = text_dev_pass(res.checkpoint, pretrain_extra) if res.checkpoint else {}
    res.seconds = time.perf_counter() - t
    return res


def rl(checkpoint: str, extra: list[str]) -> StageResult:
    t = time.perf_counter()
    cli = _cli("rl", [*extra, "--model.init_args.init_weights", checkpoint])
    before = _scalars(cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False))
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    after = {k: float(v) for k, v in cli.trainer.callback_metrics.items() if k.startswith("val/")}
    res = StageResult("RL", checkpoint=_last_checkpoint(cli.trainer), metrics=after)
    res.extra["before"] = before
    from callbacks.regression import RegressionCallback

    regression = next((cb for cb in cli.trainer.callbacks if isinstance(cb, RegressionCallback)), None)
    res.extra["regression"] = regression.history[-1] if regression is not None and regression.history else None
    res.seconds = time.perf_counter() - t
    return res


def keep_copy(checkpoint: str | None, name: str, stable: Path = STABLE) -> Path | None:
    """Hand a stage's weights on as <stable>/<name>.ckpt: a weights-only copy (the model and what the next stage
    reads, no optimizer state; `glm_lightning.export.weights_only_copy`), written atomically. The full checkpoint
    for resuming stays in the run's own folder, and the copy names it."""
    if not checkpoint:
        return None
    from glm_lightning.export import weights_only_copy

    return weights_only_copy(checkpoint, stable / f"{name}.ckpt")


def summary(stages: list[StageResult], stable: Path = STABLE, machine: str | None = None) -> str:
    """The demo's closing table (plain text, one metric per line), headed by the machine that fixes its numbers."""
    lines = ["", "== glm-lightning demo summary ==", *([f"machine: {machine}"] if machine else []),
             f"{'stage':<14}{'metric':<44}{'value':>12}"]

    def row(stage: str, metric: str, value: float | str) -> None:
        text = value if isinstance(value, str) else f"{value:.3f}"
        lines.append(f"{stage:<14}{metric:<44}{text:>12}")

    by_name = {s.name: s for s in stages}
    for s in stages:
        row(s.name, "wall time (s)", f"{s.seconds:.0f}")
    if "pre-training" in by_name:
        m = by_name["pre-training"].metrics
        for k in sorted(m):
            if k.startswith("val/dev_pass") or k in ("val/loss", "val/completion_acc"):
                row("pre-training", k, m[k])
    if "vision" in by_name:
        s = by_name["vision"]
        row("vision", "test/acc (held-out digits)", s.metrics.get("test/acc", float("nan")))
        before = by_name["pre-training"].metrics.get("val/dev_pass") if "pre-training" in by_name else None
        after = s.extra.get("text_dev_pass_after", {}).get("val/dev_pass")
        if after is not None:
            change = "" if before is None else f" (was {before:.3f})"
            row("vision", f"text val/dev_pass after vision{change}", after)
    if "RL" in by_name:
        s = by_name["RL"]
        before, after = s.extra["before"], s.metrics
        for key in ("pass@1", "pass@8", "greedy_pass"):
            for role in ("rewarded", "monitor"):
                name = f"val/{key}/{role}"
                if name in before or name in after:
                    row("RL", f"{key} {role}: before -> after",
                        f"{before.get(name, float('nan')):.3f} -> {after.get(name, float('nan')):.3f}")
        report = s.extra.get("regression")
        if report:
            for fam, r in report["families"].items():
                if r["role"] == "monitor":
                    row("RL", f"monitor {fam}: greedy {r['baseline_greedy']:.2f} -> {r['current_greedy']:.2f}",
                        r["verdict"] if r["verdict"] != "no significant change" else "no sig. change")
    lines += ["", *[f"checkpoint ({s.name}): {s.checkpoint}" for s in stages if s.checkpoint],
              f"weights handed on (no optimizer state): {stable}/{{pretrain,vision,rl}}.ckpt",
              "dashboards: tensorboard --logdir lightning_logs",
              f"next: python -m glm_lightning generate --ckpt {stable}/rl.ckpt --prompt 'def double(x):'",
              f"      python -m glm_lightning export --ckpt {stable}/rl.ckpt --out exports/demo-rl"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m glm_lightning demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-steps", type=int, default=None, help="override the pre-training steps")
    p.add_argument("--smoke", action="store_true",
                   help=f"a few steps per stage (tests); writes only under {SMOKE_ROOT}/")
    p.add_argument("--dry-run", action="store_true",
                   help="check every stage config and print the stage commands; train nothing, write nothing")
    p.add_argument("--stages", default="pretrain,vision,rl", help="comma-separated prefix of the chain to run")
    p.add_argument("--threads", default=None, metavar="N",
                   help="intra-op threads of every stage (default: this machine's cores; 'auto': the cores idle at "
                        "start). Seed + CPU kind + threads fix the demo's numbers")
    return p


def main(argv: list[str] | None = None) -> list[StageResult]:
    args = build_parser().parse_args(argv)
    stages_wanted = [s.strip() for s in args.stages.split(",") if s.strip()]
    chain = ["pretrain", "vision", "rl"]
    if not stages_wanted or stages_wanted != chain[: len(stages_wanted)]:
        raise SystemExit(f"--stages must be a prefix of {','.join(chain)} (each stage needs the previous checkpoint)")
    if args.max_steps is not None and args.max_steps < 1:
        raise SystemExit(f"--max-steps must be >= 1, got {args.max_steps}")
    from glm_lightning.threads import busy_warning, resolve_threads

    threads, how = resolve_threads(args.threads)
    what = "checking the stage configs" if args.dry_run else f"running {' -> '.join(stages_wanted)}"
    print(f"[demo] {what} with {threads} thread{'s' if threads != 1 else ''} ({how})", flush=True)
    warning = None if args.dry_run or str(args.threads).lower() == "auto" else busy_warning(threads)
    if warning:
        print(f"[demo] warning: {warning}", flush=True)
    root = SMOKE_ROOT if args.smoke else ROOT
    stable = root / "demo"
    ex = {k: list(v) for k, v in SMOKE.items()} if args.smoke else {k: [] for k in SMOKE}
    if args.max_steps is not None:
        ex["pretrain"] += ["--trainer.max_steps", str(args.max_steps),
                           "--trainer.val_check_interval", str(max(1, args.max_steps))]
    for stage in ex:
        ex[stage] += [*root_args(root, stage), "--threads", str(threads)]
    if args.dry_run:
        dry_run(stages_wanted, ex, stable)
        return []
    results = [pretrain(ex["pretrain"])]
    keep_copy(results[-1].checkpoint, "pretrain", stable)
    if "vision" in stages_wanted:
        results.append(vision(results[-1].checkpoint, ex["vision"], ex["pretrain"]))
        keep_copy(results[-1].checkpoint, "vision", stable)
    if "rl" in stages_wanted:
        results.append(rl(results[-1].checkpoint, ex["rl"]))
        keep_copy(results[-1].checkpoint, "rl", stable)
    from glm_lightning.machine import describe, machine_info

    print(summary(results, stable, describe(machine_info())))  # the stages set torch's threads in this process
    return results


def dry_run(stages: list[str], extra: dict[str, list[str]], stable: Path) -> None:
    """Check each stage's config as the demo would run it (the start weights do not exist yet, so the check uses
    `init_weights: null`) and print the equivalent commands."""
    from glm_lightning.stage_cli import check_config

    previous = {"vision": "pretrain", "rl": "vision"}
    for stage in stages:
        start = ["--model.init_args.init_weights", str(stable / f"{previous[stage]}.ckpt")] if stage in previous else []
        random_start = ["--model.init_args.init_weights", "null"] if start else []
        check_config(stage_args(stage, [*extra[stage], *random_start]))
        command = " ".join(stage_args(stage, [*extra[stage], *start]))
        print(f"[demo] {stage}: config OK\n  python -m glm_lightning fit {command}")
    print("[demo] dry run: every stage config checked; nothing was trained or written")
