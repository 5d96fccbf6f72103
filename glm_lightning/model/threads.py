"""How many intra-op (OpenMP) threads a CPU run should use: `choose_threads(cfg)`, applied by `use_threads`.

Two observations on a 2-core machine decide it:
- a model that is small enough to be bound by per-op dispatch overhead (the study models, d_model < 128) gains
  nothing from a second thread, and every one of its ~10k small ops then pays an OpenMP fork/join;
- when other processes already keep the cores busy, OpenMP threads spin-wait for a core and a step can get 5-10x
  slower (measured: study model 0.17 s/step at 1 thread vs 1.07 s at 2 threads with a load average of 3.5 on 2 cores).
So: one thread for small models; otherwise one thread per core that is not already busy (1-minute load average),
at least one. Call it once at start-up, before the work starts (the load average then counts only other processes).
"""

from __future__ import annotations

import math
import os

import torch

from glm_lightning.model.config import GLMConfig

SMALL_MODEL_WIDTH = 128
"""Below this d_model the model is dispatch-bound and runs single-threaded."""


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def idle_cores(cores: int | None = None) -> int:
    """Cores not already kept busy by other processes (from the 1-minute load average), at least 1."""
    cores = available_cores() if cores is None else cores
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return cores
    return max(1, min(cores, math.floor(cores - load + 0.5)))


def choose_threads(cfg: GLMConfig | None = None, cores: int | None = None) -> int:
    """The thread count for training or generating with a model of config `cfg` (None: judge by load only)."""
    if cfg is not None and cfg.d_model < SMALL_MODEL_WIDTH:
        return 1
    return idle_cores(cores)


def use_threads(cfg: GLMConfig | None = None, threads: int | None = None) -> int:
    """Set torch's intra-op threads to `threads`, or to `choose_threads(cfg)` when None; returns the count."""
    n = choose_threads(cfg) if threads is None else threads
    torch.set_num_threads(n)
    return n
