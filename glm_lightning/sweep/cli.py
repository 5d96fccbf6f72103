"""`python -m glm_lightning sweep --config configs/experiments/<study>.yaml [--workers N] [--seeds N] [--dry-run]
[--out DIR] [--backend local|ray] [--set KEY=VALUE ...]`; `python -m glm_lightning sweep findings [--runs DIR]`
writes the findings table (docs/results/README.md, `glm_lightning.sweep.findings`).

Exit status: 0 when every run finished, 1 when some run failed (the report is still written from the others),
2 when the study file or its config is unusable (nothing or only the first run was launched), 130 when stopped
(Ctrl-C or SIGTERM: the running runs save last.ckpt and stop; the same command resumes them).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from typing import Any
from dataclasses import dataclass, field
from pathlib import Path

from glm_lightning.sweep.runner import (LocalBackend, RayBackend, RunResult, execute, log_dir_args, plan_runs,
                                         stale_message, stale_runs)
from glm_lightning.sweep.study import Study, StudyError, load_study, validate_config

DEFAULT_OUT = "runs/sweeps"


def default_workers() -> int:
    """One worker per available core."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@dataclass
class SweepOutcome:
    study: Study
    out_dir: Path
    results: list[RunResult] = field(default_factory=list)
    report: Path | None = None
    charts: list[Path] = field(default_factory=list)

    @property
    def launched(self) -> int:
        return sum(r.status == "done" for r in self.results)

    @property
    def failed(self) -> list[RunResult]:
        return [r for r in self.results if r.status in ("failed", "cancelled")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m glm_lightning sweep",
                                description="Run a study (variants x seeds of a stage config) and report paired "
                                            "comparisons against the control.")
    p.add_argument("--config", "-c", required=True, help="study YAML, e.g. configs/experiments/ordering.yaml")
    p.add_argument("--workers", type=int, default=None, help="parallel runs (default: one per core)")
    p.add_argument("--seeds", type=int, default=None, help="use the first N seeds (extended if the study has fewer)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output root; the study goes to OUT/<study> ({DEFAULT_OUT})")
    p.add_argument("--dry-run", action="store_true", help="validate and print the run commands; run nothing")
    p.add_argument("--report-only", action="store_true",
                   help="aggregate the finished runs of the sweep that wrote the output folder (its --seeds and --set "
                        "are read from SWEEP.json there); launch nothing")
    p.add_argument("--accept-old-runs", action="store_true",
                   help="reuse finished runs of the same arguments made from other config texts, checkpoints or "
                        "package source (by default the sweep refuses and names what changed)")
    p.add_argument("--rerun-changed", action="store_true",
                   help="run again the finished runs made from other inputs (the old ones are kept as .old-<n>)")
    p.add_argument("--allow-underpowered", action="store_true",
                   help="run although the power plan shows an equivalence claim cannot be reached at these seeds "
                        "(the report names the override)")
    p.add_argument("--backend", choices=("local", "ray"), default="local")
    p.add_argument("--ray-address", default=None, help="Ray cluster address (default: $RAY_ADDRESS, else local Ray)")
    p.add_argument("--threads-per-run", type=int, default=1, help="OMP_NUM_THREADS of every run (default 1)")
    p.add_argument("--run-timeout", type=float, default=None, help="kill a run after this many seconds")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                   help="a config setting for every run, e.g. --set trainer.max_steps=20 (repeatable; YAML values)")
    p.add_argument("--n-boot", type=int, default=None, help=argparse.SUPPRESS)  # deprecated: no bootstrap any more
    return p


def parse_settings(items: list[str]) -> dict[str, Any]:
    """`["trainer.max_steps=20", ...]` -> {"trainer.max_steps": 20}; values are YAML (numbers, lists, null)."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().removeprefix("--")
        if not sep or not key:
            raise StudyError(f"--set expects KEY=VALUE (e.g. --set trainer.max_steps=20), got {item!r}")
        try:
            out[key] = yaml.safe_load(value) if value.strip() else value
        except yaml.YAMLError as err:
            raise StudyError(f"--set {item!r}: the value is not valid YAML ({err})") from None
    return out


def _seed_count(study: Study) -> int:
    """What `--seeds` means for this study: seeds in all, or per block for a study with blocks."""
    return len(next(iter(study.blocks.values())).seeds) if study.blocks else len(study.seeds)


def reproduce_command(args: argparse.Namespace, study: Study, workers: int) -> str:
    parts = ["python -m glm_lightning sweep", "--config", shlex.quote(str(args.config)), "--seeds",
             str(_seed_count(study)), "--workers", str(workers), "--out", shlex.quote(str(args.out))]
    if args.backend != "local":
        parts += ["--backend", args.backend]
    if args.threads_per_run != 1:
        parts += ["--threads-per-run", str(args.threads_per_run)]
    parts += [f"--set {shlex.quote(item)}" for item in args.settings]
    if getattr(args, "allow_underpowered", False):
        parts.append("--allow-underpowered")
    return " ".join(parts)


SWEEP_FILE = "SWEEP.json"


def record_arguments(out_dir: Path, args: argparse.Namespace, study: Study) -> None:
    """Save the sweep's arguments in its output folder, so `--report-only` finds the runs this sweep wrote."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SWEEP_FILE).write_text(json.dumps({
        "config": str(args.config), "seeds": _seed_count(study), "settings": list(args.settings),
        "threads_per_run": args.threads_per_run, "written": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1) + "\n")


def recorded_arguments(out_dir: Path) -> dict[str, Any] | None:
    """The arguments saved by the sweep that wrote `out_dir` (None when it saved none: a folder of an older sweep)."""
    try:
        data = json.loads((out_dir / SWEEP_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _with_recorded(args: argparse.Namespace, argv: list[str], out_dir: Path, log) -> str:  # noqa: ANN001
    """For --report-only: take --seeds and --set from the folder's SWEEP.json where the command line gives none.
    Returns a note for the refusal message."""
    saved = recorded_arguments(out_dir)
    if saved is None:
        return (f"{out_dir} records no sweep arguments ({SWEEP_FILE}, written by sweeps since issue 35): give the "
                f"original --seeds and --set")
    given = {a.split("=", 1)[0] for a in argv}
    if "--seeds" not in given and isinstance(saved.get("seeds"), int):
        args.seeds = saved["seeds"]
    if "--set" not in given and isinstance(saved.get("settings"), list):
        args.settings = [str(x) for x in saved["settings"]]
    if "--threads-per-run" not in given and isinstance(saved.get("threads_per_run"), int):
        args.threads_per_run = saved["threads_per_run"]
    sets = " ".join(f"--set {x}" for x in args.settings)
    log(f"[sweep] --report-only: the runs of the sweep recorded in {out_dir / SWEEP_FILE}: --seeds {args.seeds}"
        + (f" {sets}" if sets else ""))
    return f"the sweep recorded in {out_dir / SWEEP_FILE} ran --seeds {saved.get('seeds')} {sets}".rstrip()


def run_sweep(argv: list[str], log=print) -> SweepOutcome:  # noqa: ANN001
    """Everything `main` does, returning the outcome instead of exiting (raises StudyError on unusable input)."""
    args = build_parser().parse_args(argv)
    workers = args.workers or default_workers()
    if workers < 1:
        raise StudyError(f"--workers must be >= 1, got {workers}")
    if args.n_boot is not None:
        log("[sweep] --n-boot is ignored and will be removed: intervals are test-inverted t intervals, no bootstrap")
    if args.accept_old_runs and args.rerun_changed:
        raise StudyError("--accept-old-runs and --rerun-changed exclude each other: keep the old runs or redo them")
    note = ""
    if args.report_only:
        name = load_study(args.config).name
        note = _with_recorded(args, argv, (Path(args.out) / name).resolve(), log)
    study = load_study(args.config, seeds=args.seeds)
    if args.settings:
        study = study.with_settings(parse_settings(args.settings))
    out_dir = (Path(args.out) / study.name).resolve()
    log(f"[sweep] {study.name}: planning its runs and checking its config (OMP_NUM_THREADS={args.threads_per_run} "
        "per run; fingerprints and the stage CLI's imports take a few seconds)")
    specs = plan_runs(study, Path(args.out))
    validate_config(study, log_dir_args(specs[0].run_dir))
    if not args.report_only:
        from glm_lightning.sweep.plan import power_plan

        study.power_note = power_plan(study, args.allow_underpowered or args.dry_run, log)
    outcome = SweepOutcome(study, out_dir)
    stale = stale_runs(specs)

    if args.dry_run:
        from glm_lightning.sweep.runner import import_ray, read_done

        if args.backend == "ray":
            import_ray()

        log(f"[sweep] {study.name}: {len(specs)} runs ({len(study.variants)} variants x {len(study.seeds)} seeds), "
            f"config OK; output {out_dir}")
        changed = {spec.key: what for spec, what in stale}
        for spec in specs:
            state = "done" if read_done(spec) else f"stale: {'; '.join(changed[spec.key])}" \
                if spec.key in changed else "todo"
            log(f"[{state}] {spec.key}: OMP_NUM_THREADS={args.threads_per_run} "
                + " ".join(shlex.quote(a) for a in spec.command()))
        return outcome
    if stale and not (args.accept_old_runs or args.rerun_changed):
        raise StudyError(stale_message(stale, out_dir))
    if stale and args.accept_old_runs:
        log(f"[sweep] --accept-old-runs: reusing {len(stale)} run(s) made from other inputs: "
            + "; ".join(dict.fromkeys(c for _, what in stale for c in what)))

    t0 = time.perf_counter()
    if args.report_only:
        from glm_lightning.sweep.runner import finished_result, read_done

        results = []
        for spec in specs:
            done = read_done(spec, args.accept_old_runs)
            results.append(finished_result(spec, done) if done else RunResult(spec, "cancelled"))
        if not any(r.ok for r in results):
            raise StudyError(f"--report-only: no finished run of this sweep in {out_dir} ({note}); "
                             f"nothing written, REPORT.md left as it was")
    else:
        record_arguments(out_dir, args, study)
        if args.backend == "ray":
            backend = RayBackend(workers, args.threads_per_run, args.run_timeout, args.ray_address)
        else:
            backend = LocalBackend(workers, args.threads_per_run, args.run_timeout)
        results = execute(study, specs, backend, log=log, accept_old=args.accept_old_runs)
    outcome.results = results
    elapsed = time.perf_counter() - t0
    if not any(r.ok for r in results) and (out_dir / "REPORT.md").is_file():
        log(f"[sweep] no run finished: {out_dir / 'REPORT.md'} and {out_dir / 'results.json'} left as they were")
        return outcome
    write_outputs(outcome, reproduce_command(args, study, workers),
                  elapsed_s=None if args.report_only else elapsed, workers=workers)
    log(f"[sweep] report: {outcome.report}")
    return outcome


def write_outputs(outcome: SweepOutcome, reproduce: str, elapsed_s: float | None = None,
                  workers: int | None = None) -> None:
    from glm_lightning.sweep.analysis import analyse, load_curves
    from glm_lightning.sweep.findings import RESULTS_FILE, results_payload, write_results
    from glm_lightning.sweep.report import (TRAIN_CURVE_TAG, git_revision, plot_curves, plot_paired, runs_commit,
                                            write_hparams, write_report)

    study, out_dir, results = outcome.study, outcome.out_dir, outcome.results
    analyses = analyse(study, results)
    charts: list[Path] = []
    if any(r.ok for r in results):
        tags = [m.tag for m in study.metrics]
        curves = load_curves(study, results, tags + [TRAIN_CURVE_TAG])
        for r in results:  # the saved results keep the curves: read the events once
            if r.ok:
                r.curves = {t: per_seed[r.spec.seed] for t, per_seed in curves[r.spec.variant].items()
                            if r.spec.seed in per_seed}
        if any(curves[v.name][TRAIN_CURVE_TAG] for v in study.variants) and TRAIN_CURVE_TAG not in tags:
            tags.append(TRAIN_CURVE_TAG)
        charts.append(plot_curves(study, curves, tags, out_dir / f"{study.name}-curves.png"))
        charts.append(plot_paired(study, analyses[0], out_dir / f"{study.name}-paired.png"))
        write_hparams(study, results, out_dir)
    outcome.charts = charts
    outcome.report = write_report(study, analyses, results, charts, out_dir, reproduce, 0, elapsed_s, workers)
    ran_at = runs_commit([r for r in results if r.ok])
    write_results(out_dir / RESULTS_FILE, results_payload(study, results, reproduce, elapsed_s, workers, ran_at or (
        f"{git_revision()} (the report's: the runs recorded no commit)")))
    for a in analyses[:1]:
        for c in a.comparisons:
            print(f"[sweep] {a.metric.tag}: {c.verdict}")


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # the backend then stops its runs (each saves last.ckpt) and the driver exits


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["findings"]:
        from glm_lightning.sweep.findings import main as findings_main

        try:
            findings_main(argv[1:])
        except StudyError as err:
            print(f"sweep findings: error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        return
    old = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        outcome = run_sweep(argv)
    except StudyError as err:
        print(f"sweep: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("sweep: stopped; finished runs are kept and unfinished ones saved last.ckpt: run the same command "
              "again to resume", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        signal.signal(signal.SIGTERM, old)
    if outcome.failed:
        print(f"sweep: {len(outcome.failed)} of {len(outcome.results)} runs failed or did not run: "
              + ", ".join(r.spec.key for r in outcome.failed)
              + f" (details in {outcome.report or outcome.out_dir})", file=sys.stderr)
        raise SystemExit(1)
