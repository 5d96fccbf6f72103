"""The ops' real calls, recorded and replayed: what the op-choice tune (tune.py) times both forms of an op on.

A training step and a cached decode step of a model preset run once while the functions holding the ops' decision
points are wrapped (wherever a glm_lightning module holds them: the ops package re-exports them, the layers import
some), each call's arguments copied; a replay runs the calls again, a training call with its backward.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from glm_lightning.model.ops import decode as decode_ops
from glm_lightning.model.ops import dsa, kda_decode, kda_inputs, kda_recurrent, matmul, mhc, moe, norm

RECORDED: dict[str, tuple[tuple[Any, str], ...]] = {
    "rms_norm": ((norm, "rms_norm"),), "gated_head_norm": ((norm, "gated_head_norm"),),
    "sinkhorn": ((mhc, "sinkhorn"),), "stream_read": ((mhc, "stream_read"),), "stream_write": ((mhc, "stream_write"),),
    "site_read": ((mhc, "site_read"),), "swiglu": ((moe, "_swiglu_act"), (moe, "_swiglu_act_backward")),
    "rows_scatter": ((moe, "_rows_scatter"),), "rows_gather_sum": ((moe, "_rows_gather_sum"),),
    "rows_dot": ((moe, "_rows_scatter_dot"),), "moe_route": ((moe, "moe_route"),), "index_scores": ((dsa, "index_scores"),),
    "topk_mask": ((dsa, "decode_key_mask"),), "single_query_attention": ((dsa, "single_query_attention"),),
    "kda_delta_step": ((kda_decode, "delta_step_"),), "kda_conv_step": ((kda_decode, "conv_step_"),),
    "kda_decode_step": ((kda_decode, "kda_decode_step"),), "kda_features": ((kda_inputs, "kda_features"),),
    "short_conv": ((kda_inputs, "short_conv"),), "kda_recurrent": ((kda_recurrent, "kda_core"),),
    # the thresholds' calls: their weights and shapes
    "linear": ((matmul, "linear"),), "moe_experts": ((moe, "moe_experts"),),
    "decode_attention": ((dsa, "decode_attention"),),
}
"""For each op of choice.CPP_OPS (and the thresholds' ops), the functions holding its decision point, whose calls are
recorded and replayed."""

@dataclass
class Call:
    """One recorded call: the function, its arguments (tensors copied when recorded) and whether autograd recorded
    it (then a replay runs its backward too)."""

    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    grad: bool


def _copy(x: Any) -> Any:
    if isinstance(x, mhc.StreamsLink):  # a linked site read's streams: replayed as the tensor (a link is used once)
        x = x.x
    if isinstance(x, torch.Tensor):
        c = x.detach().clone()
        return c.requires_grad_() if x.requires_grad and c.is_floating_point() else c
    if isinstance(x, (tuple, list)):
        return type(x)(_copy(v) for v in x)
    return x


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _tensors(v)


@contextmanager
def recording(calls: dict[str, list[Call]], keep: str) -> Iterator[None]:
    """Record the calls of RECORDED's functions while the block runs, wherever a glm_lightning module holds them
    (the ops package re-exports them, the layers import some): per op and function the first call (``keep`` 'first',
    a training step) or the last (``keep`` 'last': a generation's last decode step, not its prefill)."""
    patched: list[tuple[object, str, object]] = []
    for op, where in RECORDED.items():
        for module, name in where:
            fn = getattr(module, name)

            def wrapper(*args: Any, __fn: Callable = fn, __op: str = op, **kwargs: Any) -> Any:
                grad = torch.is_grad_enabled() and any(t.requires_grad for t in _tensors((args, kwargs)))
                mine = [c for c in calls.setdefault(__op, []) if c.fn is __fn]
                if keep == "last" or not mine:
                    for c in mine:
                        calls[__op].remove(c)
                    calls[__op].append(Call(__fn, _copy(args), _copy(kwargs), grad))
                return __fn(*args, **kwargs)

            for mod in [m for n, m in sys.modules.items() if n.startswith("glm_lightning") and m is not None]:
                for attr, value in list(vars(mod).items()):
                    if value is fn:
                        patched.append((mod, attr, value))
                        setattr(mod, attr, wrapper)
    try:
        yield
    finally:
        for mod, attr, value in reversed(patched):
            setattr(mod, attr, value)


def record(preset: str = "flash-25m") -> dict[str, list[Call]]:
    """The ops' calls in one training step (2 x 128 tokens, forward and backward) and in the last step of a cached
    16-row generation (64-token prompt, 4 new tokens) of a fresh model of the preset (shorter where its context is)."""
    from glm_lightning.generation import generate
    from glm_lightning.model import GLMConfig, GLMModel

    torch.manual_seed(0)
    cfg = GLMConfig.preset(preset)
    model = GLMModel(cfg)
    ids = torch.randint(0, 256, (2, min(128, cfg.max_seq_len) + 1))
    calls: dict[str, list[Call]] = {}
    with recording(calls, "first"):
        out = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), ids[:, 1:].flatten()) + out.aux_loss
        loss.backward()
    model.eval()
    decode: dict[str, list[Call]] = {}
    # a decode step whose blocks call their ops one by one: the block ops run the same kernels from C++, where no
    # call would be recorded (the decode-only ops not at all, the others at the prefill's shape)
    with recording(decode, "last"), decode_ops.without(decode_ops.ENTRY_PARTS):
        prompt = torch.randint(0, 256, (1, min(64, cfg.max_seq_len - 8)))
        generate(model, prompt, max_new_tokens=4, num_samples=16, temperature=1.0, eos_id=None,
                 generator=torch.Generator().manual_seed(0))
    for op, cs in decode.items():
        calls.setdefault(op, []).extend(cs)
    return calls


def replay(calls: list[Call]) -> Callable[[], None]:
    """A function that runs the recorded calls again (each with its own copy of the arguments; in-place ops update
    that copy), a training call with its backward (gradients of ones)."""
    mine = [Call(c.fn, _copy(c.args), _copy(c.kwargs), c.grad) for c in calls]

    def run() -> None:
        for c in mine:
            if not c.grad:
                with torch.no_grad():
                    c.fn(*c.args, **c.kwargs)
                continue
            with torch.enable_grad():
                out = [t for t in _tensors(c.fn(*c.args, **c.kwargs)) if t.requires_grad]
                leaves = [t for t in _tensors((c.args, c.kwargs)) if t.requires_grad]
                torch.autograd.grad(out, leaves, [torch.ones_like(t) for t in out], allow_unused=True)

    return run
