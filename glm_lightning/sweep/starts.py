"""Pick RL start checkpoints: per pre-training run, the kept checkpoint whose greedy pass on a set of families is
closest to a target (the tutorial's RL screen started from an under-trained checkpoint at about 25%).

    python -m glm_lightning.sweep.starts --target 0.25 --out runs/starts \
        pt0=lightning_logs/rl_screen_pretrain/seed0 pt1=... [--families increment double square even reverse]
        [--per-family 32] [--split dev]

Every `*.ckpt` under a run's `checkpoints/` is evaluated (greedy completions of `per_family` tasks per family of
`split`, scored in the sandboxed verifier); the closest to the target (ties: the earlier file) is copied to
`<out>/<label>.ckpt`, and `<out>/starts.json` records for each label the source, every candidate's pass, the chosen
pass and the sha256 of the copy, which the RL reports cite (the pre-RL pass of each start). The selection uses the
dev split; the RL screen evaluates on the confirm split, so the start is not chosen on the tasks that judge it.
Each checkpoint is evaluated once: passes are cached by the file's sha256 in `<out>/candidates_cache.json`, so
`--only-evaluate` can start while pre-training still writes checkpoints, and adding a seed evaluates only its own.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from glm_lightning.sweep.fingerprint import file_digest
from glm_lightning.sweep.study import StudyError

SCREEN_FAMILIES = ("increment", "double", "square", "even", "reverse")
STARTS_FILE = "starts.json"


def greedy_pass_by_family(model: Any, families: Sequence[str], per_family: int, split: str = "dev", seed: int = 0,
                          max_new_tokens: int = 48) -> dict[str, tuple[int, int]]:
    """family -> (tasks whose greedy completion passes, tasks), verified in the sandbox."""
    from glm_lightning.evaluation import VerifierSettings, evaluate_tasks
    from glm_lightning.tasks.task import make_tasks

    tasks = make_tasks(split, per_family, list(families), seed=seed)
    verifier = VerifierSettings(workers=1).build()
    try:
        outcome = evaluate_tasks(model, tasks, verifier, greedy=True, max_new_tokens=max_new_tokens)
    finally:
        verifier.close()
    counts = {fam: [0, 0] for fam in families}
    for task, passed in zip(tasks, outcome.greedy):
        counts[task.family][0] += int(passed)
        counts[task.family][1] += 1
    return {fam: (k, n) for fam, (k, n) in counts.items()}


def _natural_key(path: Path) -> list[Any]:
    """Sort key that orders digit runs by value, so step12 comes before step100 (plain string order puts it after)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def step_of(path: Path) -> int | None:
    """The training step in a kept checkpoint's name (`step72.ckpt` -> 72), None when the name has none."""
    found = re.findall(r"\d+", path.stem)
    return int(found[-1]) if found else None


def candidates(run_dir: Path, steps: tuple[int, int] | None = None) -> list[Path]:
    """The checkpoints a pre-training run kept (`checkpoints/**/*.ckpt`, `last.ckpt` excluded: a duplicate), in step
    order: `pick` breaks ties by this order, so a tie goes to the earlier step. `steps` (first, last) keeps only
    those whose name's step lies in that range (the report then says which were candidates)."""
    found = sorted((p for p in (run_dir / "checkpoints").rglob("*.ckpt") if p.name != "last.ckpt"), key=_natural_key)
    if steps is not None and found:
        found = [p for p in found if (k := step_of(p)) is not None and steps[0] <= k <= steps[1]]
        if not found:
            raise StudyError(f"no checkpoint under {run_dir / 'checkpoints'} has a step in {steps[0]}:{steps[1]}")
    if not found:
        raise StudyError(f"no checkpoint under {run_dir / 'checkpoints'}: run the pre-training first")
    return found


def pick(passes: dict[Path, float], target: float) -> Path:
    """The checkpoint whose pass is closest to `target`; ties go to the first in `passes`' order."""
    return min(passes, key=lambda p: abs(passes[p] - target))


class PassCache:
    """Greedy passes already measured, by the checkpoint file's sha256 and the evaluation's settings, in a JSON file:
    a second invocation (another seed added, or one started while pre-training was still writing checkpoints)
    evaluates only the checkpoints it has not seen. A digest, not a path: a rewritten file is evaluated again."""

    def __init__(self, path: Path | None, settings: str) -> None:
        self.path, self.settings = path, settings
        self.data: dict[str, float] = {}
        if path is not None and path.is_file():
            try:
                self.data = {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
            except (OSError, ValueError, AttributeError):
                self.data = {}

    def key(self, ckpt: Path) -> str:
        return f"{file_digest(ckpt)}|{self.settings}"

    def get(self, ckpt: Path) -> float | None:
        return self.data.get(self.key(ckpt))

    def put(self, ckpt: Path, value: float) -> None:
        """Record a pass; the file is re-read and merged under a lock, so processes evaluating other runs' checkpoints
        into the same cache keep each other's passes."""
        self.data[self.key(ckpt)] = value
        if self.path is None:
            return
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.data = {**PassCache(self.path, self.settings).data, **self.data}
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True) + "\n")
            tmp.replace(self.path)


def choose_starts(runs: dict[str, Path], out: Path, target: float, evaluate: Callable[[Path], float],
                  log: Callable[[str], None] = print, cache: PassCache | None = None,
                  steps: tuple[int, int] | None = None) -> dict[str, dict[str, Any]]:
    """Evaluate every candidate of every run (or take its pass from `cache`), copy the chosen ones to
    `out/<label>.ckpt`, write `out/starts.json`."""
    out.mkdir(parents=True, exist_ok=True)
    record: dict[str, dict[str, Any]] = {}
    for label, run_dir in runs.items():
        passes = {}
        for ckpt in candidates(run_dir, steps):
            t0 = time.perf_counter()
            cached = cache.get(ckpt) if cache is not None else None
            passes[ckpt] = evaluate(ckpt) if cached is None else cached
            if cache is not None and cached is None:
                cache.put(ckpt, passes[ckpt])
            how = "cached" if cached is not None else f"{time.perf_counter() - t0:.0f} s"
            log(f"[starts] {label}: {ckpt} greedy pass {100 * passes[ckpt]:.1f}% ({how})")
        chosen = pick(passes, target)
        dest = out / f"{label}.ckpt"
        shutil.copyfile(chosen, dest)
        record[label] = {"source": str(chosen), "greedy_pass": passes[chosen], "sha256": file_digest(dest),
                         "candidates": {str(p): v for p, v in passes.items()}, "target": target,
                         **({"steps": list(steps)} if steps is not None else {})}
        log(f"[starts] {label}: chose {chosen} ({100 * passes[chosen]:.1f}%) -> {dest}")
    (out / STARTS_FILE).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    p = argparse.ArgumentParser(prog="python -m glm_lightning.sweep.starts", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="LABEL=RUN_DIR", help="a pre-training run directory per label")
    p.add_argument("--target", type=float, default=0.25, help="greedy pass to aim for (default 0.25)")
    p.add_argument("--families", nargs="+", default=list(SCREEN_FAMILIES))
    p.add_argument("--per-family", type=int, default=32)
    p.add_argument("--split", default="dev")
    p.add_argument("--out", default="runs/starts")
    p.add_argument("--cache", default=None, help="JSON file of passes already measured, by checkpoint digest "
                   "(default: <out>/candidates_cache.json; 'none' to evaluate everything again)")
    p.add_argument("--steps", default=None, metavar="FIRST:LAST", help="only checkpoints whose step lies in this "
                   "range (e.g. 40:100 when the pass is known to be 0 before and far above the target after; "
                   "starts.json records the range)")
    p.add_argument("--only-evaluate", action="store_true", help="fill the cache with the checkpoints that exist now "
                   "and pick nothing (e.g. while pre-training is still running)")
    args = p.parse_args(argv)
    try:
        runs = {}
        for item in args.runs:
            label, sep, path = item.partition("=")
            if not sep or not label or not Path(path).is_dir():
                raise StudyError(f"expected LABEL=RUN_DIR with an existing directory, got {item!r}")
            runs[label] = Path(path)
        if not 0 <= args.target <= 1:
            raise StudyError(f"--target is a pass rate in [0, 1], got {args.target}")
        from glm_lightning.pretrained import load_model

        def evaluate(ckpt: Path) -> float:
            counts = greedy_pass_by_family(load_model(str(ckpt)), args.families, args.per_family, args.split)
            return sum(k for k, _ in counts.values()) / max(1, sum(n for _, n in counts.values()))

        steps = None
        if args.steps:
            first, sep, last = args.steps.partition(":")
            if not sep or not first.isdigit() or not last.isdigit() or int(first) > int(last):
                raise StudyError(f"--steps is FIRST:LAST with FIRST <= LAST, got {args.steps!r}")
            steps = (int(first), int(last))
        settings = f"{','.join(args.families)}|{args.per_family}|{args.split}"
        cache_path = None if args.cache == "none" else Path(args.cache or Path(args.out) / "candidates_cache.json")
        cache = PassCache(cache_path, settings)
        if args.only_evaluate:
            for label, run_dir in runs.items():
                for ckpt in candidates(run_dir, steps):
                    if time.time() - ckpt.stat().st_mtime < 30:  # maybe still being written
                        continue
                    if cache.get(ckpt) is None:
                        cache.put(ckpt, evaluate(ckpt))
                        print(f"[starts] {label}: {ckpt} greedy pass {100 * cache.get(ckpt):.1f}% (cached for later)")
            return {}
        return choose_starts(runs, Path(args.out), args.target, evaluate, cache=cache, steps=steps)
    except StudyError as err:
        print(f"starts: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
