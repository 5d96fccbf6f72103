"""Which form of an op runs: the C++ library or PyTorch.

Whether the C++ library loaded is decided once per process (glm_lightning/model/cext.py builds and loads it at first
use; GLM_LIGHTNING_EXT=0 never does). Each op then asks one predicate, :func:`takes`, about its tensors (device,
dtype), plus its own grad and shape conditions, in one ``if``. :func:`cpp_ops` switches the library off (or back on)
for a block of code, so that a test or a benchmark can compare the two forms in one process.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from glm_lightning.model import cext

_switched_on = True
"""False inside ``cpp_ops(False)``."""


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


def takes(*tensors: torch.Tensor, fp64: bool = True) -> bool:
    """Whether the C++ ops take these tensors: all on the CPU, of one dtype, fp32 (or fp64 for the ops that have an
    fp64 instantiation, for gradcheck), and the library loaded. A decode step asks ~300 times: a plain loop."""
    dtype = tensors[0].dtype
    if dtype is not torch.float32 and not (fp64 and dtype is torch.float64):
        return False
    for t in tensors:
        if t.dtype is not dtype or not t.is_cpu:
            return False
    return _switched_on and cext.available()  # cpp_loaded(), inlined: one call fewer on a hot path


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd records an op on these tensors (the inference-only C++ ops have no backward)."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t.requires_grad:
            return True
    return False
