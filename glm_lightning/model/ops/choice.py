"""Which form of each op runs on this CPU, and where each shape threshold lies: one table, measured here (issue 49).

The C++ kernels and BLAS are not faster or slower everywhere: ``small_matmul`` beat BLAS by 1.3-2.2x on an AMD EPYC
with AVX-512 and lost by 1.1-1.6x on an Intel Xeon with AVX-512 (thresholds.py). So, as FFTW's wisdom does, the
choice is measured on the CPU at hand once and cached: ``python -m glm_lightning.model.ops.tune`` (run by ``make venv``)
times both forms of every op in turns and writes the table to
$GLM_LIGHTNING_CACHE/ops/<cpu>-<capability>-torch<version>-<library hash>-<threads>t.json; a new CPU, torch, C++
source or thread count is a new file. Until one is measured the shipped defaults hold: every C++ op on where it takes
the tensors (backend.takes) and thresholds.py's values. Noise must not flip a choice, so a measured entry differs from
the default only where the other form won by MARGIN in two thirds of the rounds (:func:`decide`).

One place decides: :func:`apply` puts the table for the thread count in force into the thresholds module (which the
ops read at call time) and into the backend's set of C++ ops switched off, which ``backend.takes(..., op=name)``
consults. It runs when glm_lightning.model.ops is imported and when a run sets its thread count
(glm_lightning.threads.use_threads). ``GLM_LIGHTNING_OP_TABLE=defaults`` pins the shipped defaults (the tests do: their
recorded numbers were made with them). Each run records the table it ran with (digest and choices) in
glm_lightning.machine.machine_info.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from glm_lightning.model import cext
from glm_lightning.model.ops import backend, thresholds

CPP_OPS = ("rms_norm", "gated_head_norm", "sinkhorn", "stream_read", "stream_write", "site_read", "swiglu",
           "rows_scatter", "rows_gather_sum", "rows_dot", "moe_route", "index_scores", "topk_mask",
           "single_query_attention", "kda_delta_step", "kda_conv_step", "kda_decode_step", "kda_features", "short_conv",
           "kda_recurrent")
"""The ops with a C++ and a PyTorch form, by the name their decision point passes to ``backend.takes``. (The chunked
KDA core's C++ op is decided in kda_chunkwise.py, not here yet.)"""

TUNED_THRESHOLDS = ("SMALL_ROWS", "SMALL_TOKENS", "DECODE_GATHER_MIN_KEYS_PER_TOP_K", "SEGMENT_TOKENS")
"""The shape thresholds of thresholds.py that the table holds (SEGMENT_PADDING stays as shipped)."""

MARGIN = 0.10
"""The other form must be at least this much faster (time ratio >= 1 + MARGIN) ..."""
ROUNDS = 5
"""... in two thirds of this many alternated rounds (4 of 5) to replace the default."""

ENV = "GLM_LIGHTNING_OP_TABLE"
"""'defaults' pins the shipped table; anything else (or unset): the measured table where there is one."""


@dataclass(frozen=True)
class Table:
    """One op-choice table: for each op whether its C++ form runs, each threshold's value, and how it was set
    (``source``: 'defaults' (nothing measured here yet), 'pinned' (ENV) or 'measured'); ``speedups`` holds, for each
    measured entry, how much faster the chosen form ran than the other (median of the rounds), for the log line."""

    cpp: Mapping[str, bool]
    thresholds: Mapping[str, float]
    source: str = "defaults"
    speedups: Mapping[str, float] = field(default_factory=dict)

    def digest(self) -> str:
        """12 hex digits naming the choices (not how they were measured): equal tables, equal digests."""
        body = json.dumps({"cpp": dict(sorted(self.cpp.items())), "thresholds": dict(sorted(self.thresholds.items()))})
        return hashlib.sha256(body.encode()).hexdigest()[:12]

    def changes(self) -> dict[str, object]:
        """The entries that differ from the shipped defaults."""
        ref = defaults()
        out: dict[str, object] = {op: "C++" if on else "PyTorch" for op, on in sorted(self.cpp.items())
                                  if on != ref.cpp.get(op, True)}
        out.update({n: v for n, v in sorted(self.thresholds.items()) if ref.thresholds.get(n) != v})
        return out

    def record(self) -> dict[str, object]:
        """What a run records (machine_info): the digest, where the table came from and its departures from the
        shipped defaults."""
        return {"digest": self.digest(), "source": self.source, "changes": self.changes()}


def defaults() -> Table:
    """The shipped table: every C++ op on, thresholds.py's shipped values."""
    return Table(cpp={op: True for op in CPP_OPS},
                 thresholds={name: thresholds.DEFAULTS[name] for name in TUNED_THRESHOLDS})


# --- the margin rule ------------------------------------------------------------------------------------------------

def decide(default_s: Sequence[float], other_s: Sequence[float], margin: float = MARGIN) -> bool:
    """Whether the other form replaces the default: it ran at least ``margin`` faster (default / other >= 1 + margin)
    in at least two thirds of the rounds (round i: default_s[i] against other_s[i]; 4 of 5). Anything less keeps the
    default. (With a bare majority, 3 of 5, single_query_attention, within ~10% of its PyTorch form here, flipped to
    PyTorch in one tune and measured 0.91x of C++ in the next run.)"""
    wins = sum(d >= (1 + margin) * o for d, o in zip(default_s, other_s, strict=True))
    return wins * 3 >= 2 * len(default_s)


def speedup(chosen_s: Sequence[float], other_s: Sequence[float]) -> float:
    """Median over the rounds of other / chosen time: how much faster the chosen form ran (< 1: slower, within the
    margin)."""
    return statistics.median(o / max(c, 1e-12) for c, o in zip(chosen_s, other_s, strict=True))


def clock() -> Callable[[], float]:
    """The clock that times the forms: at one thread this thread's CPU time, which other processes on a shared machine
    do not inflate (a tune on the 2-core machine loaded 7-9 got ~16% of a core, and its wall times flipped choices
    from round to round); with more threads the wall time (the other threads' work is not this thread's)."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def time_pair(first: Callable[[], object], second: Callable[[], object], rounds: int = ROUNDS,
              min_block_s: float = 0.005, blocks: int = 5, timer: Callable[[], float] | None = None
              ) -> tuple[list[float], list[float]]:
    """Seconds per call of two forms in ``rounds`` rounds. A round runs ``blocks`` blocks of each form in turns (first,
    second, first, ...; the round after starts with the other form) and keeps each form's fastest block: a block that
    another process preempted does not count. A block is at least ``min_block_s`` of calls (how many is fixed by a
    warm-up call of each form, after one untimed call of each). ``timer``: :func:`clock` unless given."""
    timer = clock() if timer is None else timer
    warm = []
    for fn in (first, second, first, second):
        t = timer()
        fn()
        warm.append(timer() - t)
    reps = [max(1, min(1000, int(min_block_s / max(w, 1e-9)) + 1)) for w in warm[2:]]
    times: tuple[list[float], list[float]] = ([], [])
    for r in range(rounds):
        best = [float("inf"), float("inf")]
        for _ in range(blocks):
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                fn = (first, second)[i]
                t = timer()
                for _ in range(reps[i]):
                    fn()
                best[i] = min(best[i], (timer() - t) / reps[i])
        times[0].append(best[0])
        times[1].append(best[1])
    return times


def threshold_from(sizes: Sequence[int], small_form: Mapping[int, bool], default: int, inclusive: bool) -> int:
    """A threshold from the form chosen at each measured size: the small form (C++ ``small_matmul`` for SMALL_*, the
    mask for DECODE_GATHER_*) runs at size s iff s <= threshold (``inclusive``) or s < threshold. The small form's
    region is the run of sizes from the smallest where it was chosen; the default stays if it splits the sizes
    there, else the threshold moves to the edge of that run."""
    sizes = sorted(sizes)
    run = 0
    while run < len(sizes) and small_form[sizes[run]]:
        run += 1
    lo = sizes[run - 1] if run else None  # the largest size of the small form's run
    hi = sizes[run] if run < len(sizes) else None  # the smallest size after it
    if inclusive:
        if (lo is None or default >= lo) and (hi is None or default < hi):
            return default
        return 0 if lo is None else lo
    if (lo is None or default > lo) and (hi is None or default <= hi):
        return default
    return hi if hi is not None else lo + 1


# --- the cache --------------------------------------------------------------------------------------------------------

def library_tag() -> str:
    """The C++ library's source hash (its file name's), or 'noext' where the C++ ops are switched off."""
    return cext.library_path().stem.rsplit("_", 1)[-1] if cext.enabled() else "noext"


def cpu_name() -> str:
    """The CPU's model name, as the C++ library's cache key reads it (glm_lightning.machine records runs with the same
    name; it imports this module, so not the other way round)."""
    return cext._cpu_model().split(":", 1)[-1].strip() or "unknown"


def cache_path(threads: int) -> Path:
    """Where this CPU's table at ``threads`` threads lives, for this torch and these C++ sources."""
    cpu = re.sub(r"[^A-Za-z0-9.]+", "-", cpu_name()).strip("-")[:60]
    capability = torch.backends.cpu.get_cpu_capability()
    name = f"{cpu}-{capability}-torch{torch.__version__.replace('+', '-')}-{library_tag()}-{threads}t"
    root = Path(os.environ.get("GLM_LIGHTNING_CACHE", Path.home() / ".cache" / "glm_lightning"))
    return root / "ops" / f"{name}.json"


def save(table: Table, threads: int, details: Mapping[str, object] | None = None) -> Path:
    """Write a measured table (and the measurements behind it, for reading) where :func:`load` finds it."""
    path = cache_path(threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"cpp": dict(table.cpp), "thresholds": dict(table.thresholds), "speedups": dict(table.speedups),
            "digest": table.digest(), "measured_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "margin": MARGIN, "details": dict(details or {})}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(body, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    return path


def _parse(text: str) -> Table:
    """A table from its file; ValueError if it is not one. Unknown names are ignored, missing ones take defaults."""
    body = json.loads(text)
    if not isinstance(body, dict) or not isinstance(body.get("cpp"), dict) or not isinstance(body.get("thresholds"),
                                                                                               dict):
        raise ValueError("not an op table")
    ref = defaults()
    cpp = dict(ref.cpp)
    for op, on in body["cpp"].items():
        if op in cpp:
            if not isinstance(on, bool):
                raise ValueError(f"cpp.{op} is not true or false")
            cpp[op] = on
    limits = dict(ref.thresholds)
    for name, value in body["thresholds"].items():
        if name in limits:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"thresholds.{name} is not a non-negative number")
            limits[name] = value
    speedups = {k: float(v) for k, v in body.get("speedups", {}).items() if isinstance(v, (int, float))}
    return Table(cpp=cpp, thresholds=limits, source="measured", speedups=speedups)


def load(threads: int) -> Table:
    """The table for this CPU at ``threads`` threads: pinned defaults (ENV), the measured one, or the defaults when
    none was measured. A file that cannot be read as a table is ignored, with one line saying so."""
    if os.environ.get(ENV, "").strip().lower() in ("defaults", "default", "shipped"):
        return Table(cpp=defaults().cpp, thresholds=defaults().thresholds, source="pinned")
    path = cache_path(threads)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return defaults()
    except OSError as e:
        _say(f"[ops] ignoring the op table {path} ({e}); shipped defaults")
        return defaults()
    try:
        return _parse(text)
    except (ValueError, TypeError, AttributeError) as e:
        _say(f"[ops] ignoring the op table {path} (corrupt: {e}); shipped defaults until "
             "`python -m glm_lightning.model.ops.tune` measures it again")
        return defaults()


# --- in force ---------------------------------------------------------------------------------------------------------

_tables: dict[int, Table] = {}
"""Tables loaded in this process, by thread count."""
_active: Table | None = None
_logged = False


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def apply(threads: int | None = None) -> Table:
    """Put the table for ``threads`` (default: torch's thread count now) in force: its thresholds into the thresholds
    module, its C++ choices into the backend. Logs the table once per process (not when pinned)."""
    global _active, _logged
    threads = torch.get_num_threads() if threads is None else threads
    table = _tables.get(threads)
    if table is None:
        table = _tables[threads] = load(threads)
    for name, value in table.thresholds.items():
        setattr(thresholds, name, value)
    backend.set_cpp_off(op for op, on in table.cpp.items() if not on)
    _active = table
    if not _logged and table.source != "pinned":
        _logged = True
        _say(log_line(table, threads))
    return table


@contextmanager
def using(table: Table) -> Iterator[None]:
    """Run the block with ``table``'s choices (a benchmark comparing two tables in one process), then restore."""
    before = ({name: getattr(thresholds, name) for name in table.thresholds}, backend._cpp_off)
    for name, value in table.thresholds.items():
        setattr(thresholds, name, value)
    backend.set_cpp_off(op for op, on in table.cpp.items() if not on)
    try:
        yield
    finally:
        for name, value in before[0].items():
            setattr(thresholds, name, value)
        backend.set_cpp_off(before[1])


def active() -> Table:
    """The table in force (applying the one for the current thread count if none is yet)."""
    return _active if _active is not None else apply()


def forget() -> None:
    """Drop the loaded tables (a test that writes a cache file; the tuner after measuring)."""
    global _active
    _tables.clear()
    _active = None


def log_line(table: Table, threads: int) -> str:
    """One line naming the table: what was measured and what differs from the shipped defaults."""
    where = f"{cpu_name()}, {threads} thread{'s' if threads != 1 else ''}"
    if table.source != "measured":
        return (f"[ops] shipped op table {table.digest()} (not measured on {where}: "
                "python -m glm_lightning.model.ops.tune)")
    parts = []
    for op in CPP_OPS:
        if op in table.speedups:
            parts.append(f"{op} -> {'C++' if table.cpp[op] else 'PyTorch'} ({table.speedups[op]:.2f}x)")
    for name in TUNED_THRESHOLDS:
        if name in table.speedups or table.thresholds[name] != thresholds.DEFAULTS[name]:
            parts.append(f"{name} -> {table.thresholds[name]:g}")
    return f"[ops] measured on {where}, table {table.digest()}: " + ", ".join(parts)
