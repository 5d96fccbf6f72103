"""How the ops meet bf16: bf16-mixed training (``torch.autocast("cpu", torch.bfloat16)``) and bf16 weights.

The policy, one rule per kind of op:

- **GEMMs** (``linear``, the MoE experts, the indexer's products) compute in bf16 when autocast asks for bf16 or an
  operand is bf16: operands rounded to bf16, products accumulated in fp32, the output rounded to bf16, and the
  backward's GEMMs likewise (their grads bf16, cast to the fp32 master weights by autograd). Through :func:`mm`,
  :func:`addmm`, :func:`bmm` and :func:`product`: with fp32 operands and autocast off they are the plain torch
  calls (no extra dispatched op). Attention (:func:`attention`) computes in fp32 and gives bf16: torch's CPU bf16
  SDPA is slower than its fp32 one.
- **Everything else** (norm statistics, softmax, Sinkhorn and the mHC streams, the KDA conv, features, state
  recurrence and head norm, the MoE routing, the indexer's scores) computes in fp32: :func:`fp32_op` casts an op's
  bf16 inputs to fp32 at its boundary and runs it with autocast off, so the C++ ops (fp32 only) get fp32 and the
  PyTorch forms' own products stay fp32. The losses take ``logits.float()``. Except the MoE's SwiGLU and row moves
  (ops/moe.py), which sit between the experts' bf16 GEMMs: their C++ ops take bf16 and compute in fp32, each output
  rounded to bf16 once (casting the padded [E, cap, 2h] batch to fp32 and back would cost more than the op; the eager
  bf16 forms rounded after every op and took ~2x the fp32 C++ op's time).

Which bf16 GEMM kernel runs is chosen here and only here (:func:`gemm_mode`): ``native`` is torch's bf16 kernel, what a
CPU with bf16 dot-product instructions (avx512_bf16, amx_bf16; glm_lightning/precision.py) runs fast; ``emulated``
computes each bf16 GEMM as an fp32 GEMM on the bf16-rounded operands (exact products in fp32, fp32 accumulation: the
numerics of the native instructions up to summation order) and rounds the output to bf16. Emulation is for CPUs
without native bf16, where torch's bf16 kernels are a slow reference loop (50-400x slower than fp32 on the 2-core AVX2
development machine): it runs bf16-mixed at about fp32 speed, so that bf16's quality can be studied there. It is not
a speed-up. ``GLM_LIGHTNING_BF16_GEMM=native|emulated`` overrides the detection; :func:`bf16_gemm` does for a block.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from glm_lightning import precision

BF16 = torch.bfloat16
_B = TypeVar("_B")
MODES = ("native", "emulated")
ENV = "GLM_LIGHTNING_BF16_GEMM"

_forced: str | None = None
"""The mode inside ``bf16_gemm(mode)``; None: the environment, else the detection."""


@functools.lru_cache(maxsize=1)
def _detected_mode() -> str:
    env = os.environ.get(ENV, "").strip().lower()
    if env in MODES:
        return env
    if env not in ("", "auto"):
        raise ValueError(f"{ENV}={env!r}: expected one of native, emulated, auto")
    return "native" if precision.native_bf16() else "emulated"


def gemm_mode() -> str:
    """The bf16 GEMM kernel: ``native`` (torch's bf16 kernels) or ``emulated`` (fp32 GEMMs on bf16-rounded operands)."""
    return _forced or _detected_mode()


@contextmanager
def bf16_gemm(mode: str) -> Iterator[None]:
    """Run the block's bf16 GEMMs with the ``native`` or the ``emulated`` kernel (tests, benchmarks)."""
    global _forced
    if mode not in MODES:
        raise ValueError(f"bf16 GEMM mode {mode!r}: expected one of {MODES}")
    before, _forced = _forced, mode
    try:
        yield
    finally:
        _forced = before


def autocast_bf16() -> bool:
    """Whether CPU autocast is on with bf16 (``bf16-mixed``)."""
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") is BF16


def lowp(*tensors: Tensor | None) -> bool:
    """Whether a GEMM on these operands computes in bf16: autocast bf16 is on, or an operand is bf16."""
    if autocast_bf16():
        return True
    for t in tensors:
        if t is not None and t.dtype is BF16:
            return True
    return False


def to_bf16(t: Tensor | None) -> Tensor | None:
    """t as bf16 (the op boundary of a GEMM op: recorded by autograd, so the grad goes back in t's dtype)."""
    return t if t is None or t.dtype is BF16 else t.to(BF16)


def _rounded32(t: Tensor) -> Tensor:
    """t's bf16-rounded values as fp32 (exact for a bf16 t)."""
    return t.float() if t.dtype is BF16 else t.to(BF16).float()


@contextmanager
def _autocast_off() -> Iterator[None]:
    if torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            yield
    else:
        yield


def autocast_off_backward(backward: Callable[..., _B]) -> Callable[..., _B]:
    """Run an op's autograd backward with autocast off, whatever the caller's state. Why: a backward called inside an
    autocast region (a manual optimization's backward inside training_step, where Lightning's bf16-mixed autocast is
    on) would otherwise autocast the backward's PyTorch GEMMs to bf16 and meet its fp32 tensors in the in-place ops
    (``baddbmm_``: "Input dtypes must be the same"); the backwards pick their dtypes from their saved tensors, as in
    a backward outside autocast (Lightning's automatic optimization)."""

    @functools.wraps(backward)
    def run(ctx: Any, *grads: Any) -> _B:
        with _autocast_off():
            return backward(ctx, *grads)

    return run


def _bf16_gemm(fn: Callable[..., Tensor], *operands: Tensor, out: Tensor | None = None) -> Tensor:
    """fn(*operands) as a bf16 GEMM: bf16 operands, fp32 accumulation, bf16 output (into ``out`` when given)."""
    with _autocast_off():
        if gemm_mode() == "native":
            y = fn(*(to_bf16(t) for t in operands))
        else:
            y = fn(*(_rounded32(t) for t in operands)).to(BF16)
    if out is None:
        return y
    return out.copy_(y)


def mm(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """``torch.mm(a, b)`` (into ``out``), in bf16 under the policy above."""
    if not lowp(a, b):
        return torch.mm(a, b) if out is None else torch.mm(a, b, out=out)
    return _bf16_gemm(torch.mm, a, b, out=out)


def addmm(bias: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``torch.addmm(bias, a, b)``, in bf16 under the policy above."""
    if not lowp(bias, a, b):
        return torch.addmm(bias, a, b)
    return _bf16_gemm(torch.addmm, bias, a, b)


def bmm(a: Tensor, b: Tensor) -> Tensor:
    """``torch.bmm(a, b)``, in bf16 under the policy above."""
    if not lowp(a, b):
        return torch.bmm(a, b)
    return _bf16_gemm(torch.bmm, a, b)


def product(a: Tensor, b: Tensor) -> Tensor:
    """``torch.matmul(a, b)``, in bf16 under the policy above."""
    if not lowp(a, b):
        return torch.matmul(a, b)
    return _bf16_gemm(torch.matmul, a, b)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False,
              gqa: bool = False) -> Tensor:
    """``F.scaled_dot_product_attention`` (bool ``mask`` or ``causal``). Under bf16 (autocast, or a bf16 operand) it
    runs torch's fp32 kernel on the fp32 values of q, k, v, whatever :func:`gemm_mode` says, and rounds the output to
    bf16; differentiable. Why fp32: torch's CPU bf16 SDPA is no AMX kernel but a slower loop (flash-25m 32 x 128, 3
    DSA layers, Intel Xeon AVX-512 + AMX, 1 thread: fwd + bwd 405 ms in bf16 against 114 ms in fp32), and its two
    products are 1.5% of the step's FLOPs; the softmax was fp32 in either kernel. The grads reach bf16 operands as
    bf16 (autograd's casts)."""
    if not lowp(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    with _autocast_off():
        y = F.scaled_dot_product_attention(_f32(q), _f32(k), _f32(v), attn_mask=mask, is_causal=causal,
                                           enable_gqa=gqa)
    return y.to(BF16)


# --- the fp32 ops ---------------------------------------------------------------------------------------------------
_T = TypeVar("_T")


def _f32(a: Any) -> Any:
    return a.float() if isinstance(a, Tensor) and a.dtype in (BF16, torch.float16) else a


def fp32_op(fn: Callable[..., _T]) -> Callable[..., _T]:
    """Make ``fn`` an fp32 op: under autocast, or given bf16 tensors, its bf16/fp16 tensor arguments are cast to fp32
    and it runs with autocast off (its outputs are then fp32). Otherwise it is called as it is (one check)."""

    @functools.wraps(fn)
    def op(*args: Any, **kwargs: Any) -> _T:
        if not torch.is_autocast_enabled("cpu"):
            for a in args:
                if isinstance(a, Tensor) and a.dtype is BF16:
                    break
            else:
                if not any(isinstance(a, Tensor) and a.dtype is BF16 for a in kwargs.values()):
                    return fn(*args, **kwargs)
        with _autocast_off():
            return fn(*(_f32(a) for a in args), **{k: _f32(v) for k, v in kwargs.items()})

    return op
