"""Which form of an op runs: the C++ library or PyTorch.

Whether the C++ library loaded is decided once per process (glm_lightning/model/cext.py builds and loads it at first
use; GLM_LIGHTNING_EXT=0 never does). Each op then asks one predicate, :func:`takes`, about its tensors (device,
dtype) and its name, plus its own grad and shape conditions, in one ``if``. The name is looked up in the set of C++ ops
that this CPU's measured op table switches off (choice.py puts it here: :func:`set_cpp_off`). :func:`cpp_ops` switches
the library off (or back on) for a block of code, :func:`cpp_ops_off` some ops only, so that a test or a benchmark can
compare the two forms in one process.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from glm_lightning.model import cext

_switched_on = True
"""False inside ``cpp_ops(False)``."""
_cpp_off: frozenset[str] = frozenset()
"""Names of the ops whose PyTorch form runs even where their C++ op takes the tensors (the op table's choice)."""


def cpp_loaded() -> bool:
    """Whether the C++ ops may run: the library loaded (decided once) and not switched off."""
    return _switched_on and cext.available()


@contextmanager
def cpp_ops(enabled: bool) -> Iterator[None]:
    """Run the block with the C++ ops on (if the library loaded) or off (the PyTorch forms only)."""
    global _switched_on
    before, _switched_on = _switched_on, enabled
    try:
        yield
    finally:
        _switched_on = before


def set_cpp_off(ops: Iterable[str]) -> None:
    """Run the PyTorch forms of these ops (by the names they pass to :func:`takes`), the C++ forms of all others."""
    global _cpp_off
    _cpp_off = frozenset(ops)


@contextmanager
def cpp_ops_off(ops: Iterable[str]) -> Iterator[None]:
    """Run the block with exactly these ops' PyTorch forms (the others' C++ forms, where the library loaded)."""
    before = _cpp_off
    set_cpp_off(ops)
    try:
        yield
    finally:
        set_cpp_off(before)


def cpp_forms(ops: Iterable[str]) -> frozenset[str]:
    """Those of ``ops`` whose C++ form runs where it takes the tensors: none unless the library is loaded, else all
    that the op table does not switch off (a decode step asks once, ops/decode.py)."""
    if not cpp_loaded():
        return frozenset()
    return frozenset(op for op in ops if op not in _cpp_off)


def takes(*tensors: torch.Tensor, fp64: bool = True, op: str | None = None, bf16: bool = False) -> bool:
    """Whether the C++ op named ``op`` takes these tensors: all on the CPU, of one dtype, fp32 (or fp64 for the ops
    that have an fp64 instantiation, for gradcheck; or bf16 for those with a bf16 one, ``bf16``), the library loaded,
    and the op not switched off by the op table (choice.py). A decode step asks ~300 times: a plain loop."""
    dtype = tensors[0].dtype
    if dtype is not torch.float32 and not (fp64 and dtype is torch.float64) and not (bf16 and dtype is torch.bfloat16):
        return False
    for t in tensors:
        if t.dtype is not dtype or not t.is_cpu:
            return False
    return _switched_on and cext.available() and op not in _cpp_off  # cpp_loaded(), inlined: a hot path


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd records an op on these tensors (the inference-only C++ ops have no backward)."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t.requires_grad:
            return True
    return False
