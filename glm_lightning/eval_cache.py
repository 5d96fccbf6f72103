"""A cache for evaluations of a model's starting weights, so the seeds of a sweep measure their shared "before" once.

The seeds of an RL study start from the same checkpoint and evaluate the same tasks with a fixed evaluation seed, so
their baseline measurement is the same computation every time (at the tutorial's size: 256 confirm tasks x 9
completions, a quarter of a run). The cache key covers everything that decides the result: a digest of the weights
as they are when measured (after loading, freezing and untying), every evaluation setting, and a digest of the
package's source code, so a code change never reuses an old measurement, and torch's version and CPU capability, so
a folder shared between machines never hands one CPU's rounding to another. Entries are JSON files written atomically.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

PACKAGE_ROOT = Path(__file__).resolve().parent


def weights_digest(module: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer: name, dtype, shape and bytes."""
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 over the package's Python sources (generation, model, tasks, verifier, ...)."""
    h = hashlib.sha256()
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        h.update(str(path.relative_to(PACKAGE_ROOT)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def task_identities(tasks: Sequence[Any]) -> list[dict[str, Any]]:
    """Every field of every task, in order: a task's id (split/family/index) does not say which task it is, since
    `make_tasks` draws names, argument names and descriptions from its seed (the data seed)."""
    return [dataclasses.asdict(t) for t in tasks]


def machine() -> dict[str, str]:
    """What makes the same computation round differently: torch's version and the CPU kernels it dispatches to
    (runs repeat exactly on one machine, not across CPUs)."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def cache_key(weights: str, settings: dict[str, Any]) -> str:
    """The entry's name: weights digest + settings (JSON, sorted keys) + code digest + machine."""
    text = json.dumps({"weights": weights, "settings": settings, "code": code_digest(), "machine": machine()},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def load(directory: str | Path, key: str) -> Any | None:
    """The cached payload, or None when there is no (readable) entry."""
    path = Path(directory) / f"{key}.json"
    try:
        return json.loads(path.read_text())["payload"]
    except (OSError, ValueError, KeyError):
        return None


def store(directory: str | Path, key: str, payload: Any, settings: dict[str, Any]) -> Path:
    """Write the entry atomically (a half-written file is never read as a result)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{key}.json"
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{key}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"settings": settings, "payload": payload}, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def cached_or_computed(trainer: Any, directory: str | Path, model: torch.nn.Module, settings: dict[str, Any],
                       compute: Callable[[], Any]) -> tuple[Any, Path | None]:
    """The entry for `model`'s weights and `settings` if there is one, else `compute()` (stored by rank 0).
    Rank 0 reads and broadcasts, so all ranks agree on hit or miss (a miss computes on every rank: the evaluations
    sync across ranks). Returns (payload, the entry it was read from, or None when it was computed)."""
    key = cache_key(weights_digest(model), settings)
    cached = load(directory, key) if trainer.is_global_zero else None
    cached = trainer.strategy.broadcast(cached, src=0)
    if cached is not None:
        return cached, Path(directory) / f"{key}.json"
    payload = compute()
    if trainer.is_global_zero:
        store(directory, key, payload, settings)
    return payload, None
