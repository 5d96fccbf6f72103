"""How many intra-op (OpenMP) threads a CPU run uses: `resolve_threads()` for `--threads`, `choose_threads()` for
`--threads auto`, applied by `use_threads`.

The thread count is part of what fixes a run (seed + CPU kind + threads: summation order differs between counts), so
the default is reproducible: every core this process may use (`available_cores`, the machine's own count), whatever
else runs. `--threads N` fixes another count; `--threads auto` is the interactive choice below, named as such, whose
result depends on the load at start.

`auto`: one thread per core that other processes leave idle, at least one:
- when other processes already keep the cores busy, OpenMP threads spin-wait for a core and a step can get 5-10x
  slower (measured: study model 0.17 s/step at 1 thread vs 1.07 s at 2 threads with a load average of 3.5 on 2 cores);
- on an idle 2-core machine two threads were never slower, whatever the model (training steps, 1 vs 2 threads
  alternated in one process: study model 24x128 0.56 vs 0.50 s, tiny 16x64 0.19 vs 0.18 s, demo 16x192 1.58 vs
  1.01 s, flash-25m vision 32 x 14 tokens 1.46 vs 1.02 s). An earlier rule that gave every model narrower than 128 one
  thread cost the demo's pre-training 1.6x, so the model no longer matters, only the idle cores.
"Busy" is measured over a quarter second from /proc/stat (the CPU time other processes use right now); the 1-minute
load average is only the fallback where /proc/stat is missing, because it lags: just after a long job ends it still
reads ~2 on 2 idle cores, and a run started then would get one thread for its whole life. Call it once at start-up,
before the work starts (this process is then idle, so only other processes count).
"""

from __future__ import annotations

import math
import os
import time


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _cpu_times() -> tuple[float, float]:
    """(busy, total) CPU time summed over all CPUs so far, from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        fields = [float(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
    return total - idle, total


def busy_between(before: tuple[float, float], after: tuple[float, float], cpus: int) -> float:
    """CPUs' worth of busy time between two `_cpu_times` samples (0 .. cpus)."""
    total = after[1] - before[1]
    return 0.0 if total <= 0 else cpus * (after[0] - before[0]) / total


def busy_cores(window_s: float = 0.25) -> float | None:
    """How many cores other processes keep busy now: /proc/stat over `window_s`, else the 1-minute load average,
    else None (unknown)."""
    try:
        before = _cpu_times()
        time.sleep(window_s)  # measuring, not synchronising: other processes' CPU time accrues meanwhile
        return busy_between(before, _cpu_times(), os.cpu_count() or 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def idle_cores(cores: int | None = None) -> int:
    """Cores not already kept busy by other processes (:func:`busy_cores`), at least 1."""
    cores = available_cores() if cores is None else cores
    busy = busy_cores()
    if busy is None:
        return cores
    return max(1, min(cores, math.floor(cores - busy + 0.5)))


def choose_threads(cores: int | None = None) -> int:
    """The thread count for training or generating, whatever the model (see the module docstring): the idle cores."""
    return idle_cores(cores)


def use_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads to `threads`, or to `choose_threads()` when None, and put the op table measured at
    that count in force (glm_lightning/model/ops/choice.py); returns the count."""
    import torch  # here, not at the top: the command line names the count before the seconds of torch's import

    n = choose_threads() if threads is None else threads
    torch.set_num_threads(n)
    from glm_lightning.model.ops import choice  # the op table measured at this thread count

    choice.apply(n)
    return n


AUTO = "auto"


def resolve_threads(spec: int | str | None, env: dict[str, str] | None = None) -> tuple[int, str]:
    """The thread count for `--threads spec` and how it was chosen (said in the run's first lines):
    an integer fixes it; None takes OMP_NUM_THREADS when set (the sweep's workers), else every available core;
    'auto' takes the idle cores (load-dependent: interactive runs only)."""
    env = dict(os.environ) if env is None else env
    if spec is None or spec == "":
        omp = env.get("OMP_NUM_THREADS", "").strip()
        if omp:
            try:
                return max(1, int(omp)), "OMP_NUM_THREADS"
            except ValueError:
                raise ValueError(f"OMP_NUM_THREADS must be a whole number, got {omp!r}") from None
        return available_cores(), "this machine's cores; --threads N fixes another count"
    if str(spec).strip().lower() == AUTO:
        return choose_threads(), "auto: the cores idle at start, load-dependent; --threads N fixes the count"
    try:
        n = int(spec)
    except (TypeError, ValueError):
        raise ValueError(f"--threads must be a whole number >= 1 or 'auto', got {spec!r}") from None
    if n < 1:
        raise ValueError(f"--threads must be >= 1 (or 'auto'), got {n}")
    return n, "--threads"


def busy_warning(n: int, cores: int | None = None) -> str | None:
    """A line when other processes already keep busy some of the `n` cores a run is about to use (its threads then
    spin-wait: steps 5-10x slower); None when they are idle or the load is unknown."""
    cores = available_cores() if cores is None else cores
    busy = busy_cores()
    if n <= 1 or busy is None or min(n, cores) <= cores - busy + 0.5:
        return None
    return (f"other processes keep {busy:.1f} of {cores} cores busy: {n} threads will wait for cores and may run "
            f"several times slower; --threads {max(1, math.floor(cores - busy + 0.5))} (or auto) uses the idle ones")
