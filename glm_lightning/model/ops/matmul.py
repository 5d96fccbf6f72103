"""linear: y = x W^T + b (reference: ``F.linear``), with a hand-written backward and a decode form.

Why the Function: the study model is dispatch-bound (~15 us per op). ``F.linear`` on a [B, T, d] input records
matmul's reshape and view nodes plus ``MmBackward0`` and the weight's ``TBackward0``, which replay as ~23 dispatched ops
per layer in backward; :class:`_Linear` replays as ~9 (dx = dy W, dW = dy^T x, db = sum(dy)). Its forward is the same
``addmm``/``mm`` that ``F.linear`` runs, so values are bit for bit those of ``F.linear``. Without autograd (decoding)
it is the same ``mm``/``addmm`` called directly (7 dispatched ops instead of 11-12), or for a few rows
(thresholds.SMALL_ROWS) a C++ op that streams each weight once: inside a cached decode (:func:`packed_weights`, entered
by the model's forward with a decoding cache) ``glm_lightning::panel_matmul`` on the weight packed once per generation
into output panels (csrc/panel_matmul.cpp), else ``glm_lightning::small_matmul`` on the weight as stored.

Under bf16 (autocast, or bf16 weights) x, W and b are cast to bf16 at the op's boundary and the three GEMMs go through
mixed_precision.py (native or emulated bf16 kernels); ``fp32=True`` keeps a small projection in fp32 whatever the
autocast (the router, the KDA decay gate: their outputs feed a sigmoid that picks experts or sets a decay).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

from glm_lightning.model.ops import backend, decode, mixed_precision as mp, thresholds


def _rows(x: Tensor) -> Tensor:
    """x [..., n] as [rows, n]: a view when x is contiguous (1 dispatched op; `reshape` is 2)."""
    return x.view(-1, x.shape[-1]) if x.is_contiguous() else x.reshape(-1, x.shape[-1])


class _Linear(torch.autograd.Function):
    """x [..., in], weight [out, in], bias [out] or None -> [..., out]."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # type: ignore[override]
        x2, wt = _rows(x), weight.transpose(0, 1)  # transpose: 2 ops, .t() is 3
        y = mp.mm(x2, wt) if bias is None else mp.addmm(bias, x2, wt)
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @mp.autocast_off_backward
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:  # type: ignore[override]
        x2, weight = ctx.saved_tensors
        g2 = _rows(grad)
        gx = mp.mm(g2, weight).view(*grad.shape[:-1], weight.shape[1]) if ctx.needs_input_grad[0] else None
        gw = mp.mm(g2.transpose(0, 1), x2) if ctx.needs_input_grad[1] else None
        gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def small_matmul(x2: Tensor, weight: Tensor, counts: Tensor | None, bias: Tensor | None = None,
                 swiglu: bool = False) -> Tensor:
    """x2 [rows, in] W^T + bias (or per expert: x2 [E, cap, in] against weight [E, out, in] over ``counts`` [E] real
    rows) through the C++ op: each weight row streamed once. ``swiglu``: W = [W_gate; W_up], SiLU(gate) * up of the
    sums just made (the C++ SwiGLU's values bit for bit)."""
    return torch.ops.glm_lightning.small_matmul(x2, weight, counts, bias, swiglu=swiglu)


PANELS = True
"""Whether cached decoding packs its few-row matmuls' weights into panels (``panel_matmul``); False keeps
``small_matmul`` on the weights as stored (a switch for benchmarks/bench_decode_thresholds.py, which compares them)."""

_packs: dict[Tensor, Tensor] | None = None
"""The panel-packed weights of the decode in progress (:func:`packed_weights`), keyed by the weight tensor itself (a
dict of tensors hashes by identity); None outside one."""


@contextmanager
def packed_weights(store: dict[Tensor, Tensor] | None) -> Iterator[None]:
    """Run the block with ``store`` as the place where few-row linears and experts find (and leave) their weights'
    panel-packed copies; None: no packing. The store lives with the decoding cache (``ModelCache.packed``): weights
    cannot change during one generation but may between generations (so no key on the layer is safe)."""
    global _packs
    before, _packs = _packs, store if PANELS else None
    try:
        yield
    finally:
        _packs = before


def packed(weight: Tensor) -> Tensor | None:
    """weight [out, in] (or [E, out, in]) packed into output panels for :func:`panel_matmul`, packed on first use
    within the decode in progress unless the model kept it from an earlier one (model/kept_panels.py), in the
    store's ``dtype`` (cache.PanelStore: fp32 or bf16; a plain dict: the weight's); None outside one."""
    if _packs is None:
        return None
    p = _packs.get(weight)
    if p is None:
        with torch.inference_mode(False), torch.no_grad():  # a plain tensor, usable in and out of inference mode
            p = _packs[weight] = torch.ops.glm_lightning.panel_pack(weight, getattr(_packs, "dtype", None))
        kept = getattr(_packs, "kept", None)
        if kept is not None:  # for the model's later generations (model/kept_panels.py)
            kept.keep(weight, p)
    return p


def panel_matmul(x: Tensor, panels: Tensor, out: int, counts: Tensor | None, bias: Tensor | None = None) -> Tensor:
    """x [..., in] W^T + bias -> [..., out] (or per expert: x [E, cap, in] over ``counts`` [E] real rows) from W packed
    by :func:`packed` (``out`` = W's rows): each panel streamed once, no horizontal sums; one dispatched op."""
    return torch.ops.glm_lightning.panel_matmul(x, panels, out, counts, bias)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, fp32: bool = False) -> Tensor:
    """``F.linear(x, weight, bias)``; while autograd records, through :class:`_Linear` (fewer backward ops). Under
    bf16 (autocast or bf16 operands) its GEMMs run in bf16 (module docstring); with ``fp32`` in fp32 whatever the
    autocast."""
    f32 = torch.float32
    if (_packs is not None and decode.cpp("linear") and x.dtype is f32 and weight.dtype is f32 and x.dim() >= 2
            and (bias is None or bias.dtype is f32) and x.numel() <= thresholds.SMALL_ROWS * x.shape[-1]):
        return panel_matmul(x, packed(weight), weight.shape[0], None, bias)  # an fp32 decode step: asked once per step
    if fp32:
        return _linear_fp32(x, weight, bias)
    if mp.lowp(x, weight, bias):
        x, weight, bias = mp.to_bf16(x), mp.to_bf16(weight), mp.to_bf16(bias)
    if backend.needs_grad(x, weight, *(() if bias is None else (bias,))):
        return _Linear.apply(x, weight, bias)
    if x.dim() < 2 or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    if _packs is not None and x.numel() <= thresholds.SMALL_ROWS * x.shape[-1] and backend.takes(
            x, weight, *(() if bias is None else (bias,)), fp64=False):  # a decode: [..., in] -> [..., out], one op
        return panel_matmul(x, packed(weight), weight.shape[0], None, bias)
    x2 = _rows(x)
    if x2.shape[0] <= thresholds.SMALL_ROWS and backend.takes(x2, weight, *(() if bias is None else (bias,)),
                                                               fp64=False):
        y = small_matmul(x2, weight, None, bias)
    else:  # the same mm/addmm that F.linear runs on the flattened rows, in 7 dispatched ops instead of 11-12
        wt = weight.transpose(0, 1)
        y = mp.mm(x2, wt) if bias is None else mp.addmm(bias, x2, wt)
    return y.view(*x.shape[:-1], weight.shape[0])


@mp.fp32_op
def _linear_fp32(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return linear(x, weight, bias)
