"""Reading scalars back from a run's TensorBoard event files (all points kept: size_guidance 0)."""

from __future__ import annotations

from pathlib import Path

EVENT_GLOB = "events.out.tfevents.*"


def event_files(run_dir: str | Path) -> list[Path]:
    """Event files anywhere under a run directory, oldest first (a resumed run has one per attempt), except the
    run's own HPARAMS summary (`hparams/`, final values again under `hparams/<tag>`)."""
    root = Path(run_dir)
    files = [p for p in root.rglob(EVENT_GLOB) if "hparams" not in p.relative_to(root).parts[:-1]]
    return sorted(files, key=lambda p: (p.stat().st_mtime, str(p)))


def read_scalars(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """`{tag: [(step, value), ...]}` of every scalar in the run, sorted by step; if a step was written twice (e.g.
    by two event files), the later write wins."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    merged: dict[str, dict[int, float]] = {}
    for path in event_files(run_dir):
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0, "histograms": 1, "images": 1})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            series = merged.setdefault(tag, {})
            for ev in acc.Scalars(tag):
                series[int(ev.step)] = float(ev.value)
    return {tag: sorted(points.items()) for tag, points in merged.items()}


def final_values(scalars: dict[str, list[tuple[int, float]]]) -> tuple[dict[str, float], dict[str, int]]:
    """Last value (and its step) of every tag."""
    return ({tag: pts[-1][1] for tag, pts in scalars.items() if pts},
            {tag: pts[-1][0] for tag, pts in scalars.items() if pts})
