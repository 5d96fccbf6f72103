"""A cached fp32 decode step's backend decisions, made once per step instead of once per op call.

Why: a decode step is bound by Python and dispatch, not by its arithmetic (flash-25m, 16 rows: ~25 ms of which ~12 in
the weight-streaming matmuls). Every op entry re-asks the same questions (autocast on? bf16 operands? library loaded?
op switched off by the op table? autograd recording?), ~10 us of Python around an op of ~10 us: an RMSNorm call
cost ~21 us against ~9 for the C++ op alone, a site read ~59 against ~35 (Intel Xeon, 1 thread, loaded machine).

:func:`fp32_step` is entered by ``GLMModel.forward`` around a decode step (one token per row, a cache, no autograd)
of a model with fp32 CPU weights, outside autocast. Inside it, :func:`cpp` says whether a decode-only entry of an op
may call its C++ op directly: the library is loaded and the op table leaves that op's C++ form on (decided at entry).
The entries still check what differs per call (a tensor's dtype, contiguity, padding) and fall back to the op's
general form otherwise, so values are those of the general form's C++ op, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from glm_lightning.model.ops import backend

OPS = ("rms_norm", "site_read", "stream_write", "kda_decode_step", "moe_route", "rotary", "linear", "moe_decode",
       "moe_half", "kda_block", "kda_block_pads", "dsa_block")
"""The ops with a decode-only entry (by the names they pass to ``backend.takes``), a block op after the entries it
calls."""

PARTS = {"moe_decode": ("linear", "moe_route", "swiglu", "rows_scatter", "rows_gather_sum"),
         "dsa_block": ("index_scores", "topk_mask"),
         "kda_block_pads": ("kda_conv_step", "kda_features", "kda_delta_step", "gated_head_norm")}
"""The ops whose kernels a fused decode op calls: it is on only where all of them are (same values as their path)."""

ENTRY_PARTS = {"moe_half": ("site_read", "rms_norm", "stream_write", "moe_decode"),
               "kda_block": ("moe_half", "linear", "kda_decode_step"),
               "kda_block_pads": ("kda_block",),
               "dsa_block": ("moe_half", "linear", "rms_norm", "rotary")}
"""The decode entries whose C++ forms a block op (ops/block_decode.py) calls: it is on only where all of them are."""

FUSED = tuple(dict.fromkeys((*PARTS, *ENTRY_PARTS)))
"""The decode ops that call other ops' kernels from C++ (moe_decode and the block ops)."""


@contextmanager
def without(ops: Iterable[str]) -> Iterator[None]:
    """Decode steps inside run with the decode entries of ``ops`` off, so that the ops they stand for are called one
    by one (where the op-choice tune records the calls, a benchmark wraps the matmuls or compares forms)."""
    global OPS
    off = frozenset(ops)
    before, OPS = OPS, tuple(op for op in OPS if op not in off)
    try:
        yield
    finally:
        OPS = before


_on: frozenset[str] = frozenset()
"""The ops of OPS whose C++ form the decode step in progress calls directly; empty outside one."""


@contextmanager
def fp32_step(active: bool) -> Iterator[None]:
    """Run the block as a decode step of an fp32 CPU model (``active``; else a no-op): the decode-only entries of the
    ops whose C++ form is on call it directly. Outside autocast only (under it the ops cast at their boundary)."""
    global _on
    before = _on
    _on = _cpp_forms() if active and not torch.is_autocast_enabled("cpu") else frozenset()
    try:
        yield
    finally:
        _on = before


def _cpp_forms() -> frozenset[str]:
    """The ops of OPS whose C++ form is on, a fused op only with all its PARTS and ENTRY_PARTS."""
    on = backend.cpp_forms((*OPS, *(p for parts in PARTS.values() for p in parts)))
    chosen: set[str] = set()
    for op in OPS:  # a block op after the entries it calls
        if op in on and on.issuperset(PARTS.get(op, ())) and chosen.issuperset(ENTRY_PARTS.get(op, ())):
            chosen.add(op)
    return frozenset(chosen)


def cpp(op: str) -> bool:
    """Whether the decode step in progress calls ``op``'s C++ form directly (see :func:`fp32_step`)."""
    return op in _on
