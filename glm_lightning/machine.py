"""What machine a run ran on: the facts that, with the seed, fix its result (CPU kind, torch's CPU capability,
thread count, library versions, the op table: which form of each op ran).

A seed fixes a run only on one CPU kind at one thread count (kernels and summation order differ otherwise), so every
run records :func:`machine_info` with its hyper-parameters and every study compares only runs whose
:func:`cpu_key` agree. Imports torch lazily so that the command line can name the machine before the heavy imports.
"""

from __future__ import annotations

import platform
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name ('AMD EPYC 9R14 96-Core Processor'), else the platform's processor string."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_capability() -> str:
    """torch's CPU capability ('AVX512', 'AVX2', 'DEFAULT', ...): which kernels ATen dispatches to here."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def cpu_key() -> str:
    """One string naming the CPU kind: runs with different keys are not expected to agree bit for bit."""
    return f"{cpu_model()} [{cpu_capability()}]"


def machine_info() -> dict[str, object]:
    """The run's machine: CPU model and capability, the intra-op thread count in force, versions, and the op table in
    force (which form of each op ran: its digest, source and departures from the shipped defaults)."""
    import torch

    info: dict[str, object] = {
        "cpu": cpu_model(),
        "cpu_capability": cpu_capability(),
        "threads": int(torch.get_num_threads()),
        "torch": str(torch.__version__),
        "python": platform.python_version(),
    }
    from glm_lightning.model.ops import choice  # which form of each op ran: the op table in force

    info["op_table"] = choice.active().record()
    try:
        import lightning

        info["lightning"] = str(lightning.__version__)
    except ImportError:  # pragma: no cover - lightning is a hard dependency; kept for library use without it
        pass
    return info


def describe(info: dict[str, object] | None = None) -> str:
    """One line for logs: 'AMD EPYC 9R14 [AVX512], 1 thread, torch 2.14.1, op table 3f0c9a1b2d4e (measured)'."""
    info = machine_info() if info is None else info
    n = info["threads"]
    line = f"{info['cpu']} [{info['cpu_capability']}], {n} thread{'s' if n != 1 else ''}, torch {info['torch']}"
    table = info.get("op_table")
    if isinstance(table, dict):
        line += f", op table {table.get('digest')} ({table.get('source')})"
    return line
