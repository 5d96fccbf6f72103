"""Whether this CPU computes bf16 natively, and the one log line (and warning) a run prints about it.

A CPU has native bf16 dot products when ``/proc/cpuinfo`` lists ``avx512_bf16`` (or ``amx_bf16``). Without them
PyTorch's bf16 matmuls fall back to a reference kernel: on the 2-core AVX2 development machine (torch 2.14.1, 2
threads) 0.3-1.7 GFLOP/s against 83-135 GFLOP/s in fp32, 50-400x slower. So fp32 ("32-true") stays every stage's
default; bf16 is opt-in (``--trainer.precision bf16-mixed``, the generation and RL rollout ``precision`` settings), and
where it is not native the ops layer emulates the bf16 GEMMs in fp32 (glm_lightning/model/ops/mixed_precision.py):
the numerics of bf16 at about fp32 speed, for studying bf16's quality here, never a speed-up.
"""

from __future__ import annotations

import functools
from pathlib import Path

PRECISIONS = ("32", "bf16")
"""The `precision` values of generation: the model's own fp32 weights, or a bf16 copy of its matrices."""

NATIVE_FLAGS = ("avx512_bf16", "amx_bf16")
"""/proc/cpuinfo flags of a CPU with bf16 dot-product instructions (in the order the log line prefers)."""


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str] | None:
    """The CPU's feature flags (the first ``flags`` line of cpuinfo), or None when the file is unreadable."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def native_flag(flags: set[str] | None) -> str | None:
    """The first of :data:`NATIVE_FLAGS` among ``flags`` (None: no native bf16, or flags unknown)."""
    if not flags:
        return None
    return next((f for f in NATIVE_FLAGS if f in flags), None)


@functools.lru_cache(maxsize=1)
def native_bf16() -> bool:
    """Whether this CPU has native bf16 dot products (decided once per process; False when cpuinfo is unreadable)."""
    return native_flag(cpu_flags()) is not None


def describe() -> str:
    """The one line a run logs at start: ``bf16: native (avx512_bf16) ...`` or ``bf16: not native (...) ...``."""
    flags = cpu_flags()
    flag = native_flag(flags)
    if flag is not None:
        return f"bf16: native ({flag}): bf16 matmuls use the CPU's bf16 instructions"
    why = "cpuinfo unreadable" if flags is None else "no avx512_bf16 / amx_bf16 in /proc/cpuinfo"
    return (f"bf16: not native ({why}): bf16 matmuls are emulated as fp32 GEMMs on bf16-rounded operands "
            f"(bf16 numerics at about fp32 speed, no speed-up); fp32 is the default")


def is_bf16(precision: object) -> bool:
    """Whether a Lightning ``precision`` value or a generation ``precision`` setting asks for bf16."""
    return "bf16" in str(precision)


_logged: set[str] = set()


def log_start(precision: object = None, what: str = "run") -> None:
    """When ``precision`` asks for bf16: log :func:`describe` once per process and, on a CPU without native bf16,
    one warning saying what that means (once per process and ``what``). An fp32 run says nothing about bf16."""
    from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

    if not is_bf16(precision):
        return
    if "line" not in _logged:
        _logged.add("line")
        rank_zero_info(describe())
    if is_bf16(precision) and not native_bf16() and what not in _logged:
        _logged.add(what)
        rank_zero_warn(f"bf16 asked for ({what}: {precision}) on a CPU without native bf16: its matmuls are emulated "
                    "(fp32 GEMMs on bf16-rounded operands, outputs rounded to bf16), so the run has bf16's numerics "
                    "at about fp32 speed, not bf16's speed (torch's own bf16 kernels are 50-400x slower here; "
                    "GLM_LIGHTNING_BF16_GEMM=native forces them)")
