"""A cached decode step with each of its decode-only forms against the form it replaced, taking turns in one process.

flash-25m, 16 rows after a 64-token prompt, one thread. Each round derives fresh caches from the prefill's (same
length, the packed weights shared) and times one decode step per form, the order alternating between rounds, so that
load changes on a shared machine hit every form alike. Reported per form: the median CPU ms of a step (process time:
on a machine shared with processes of the same priority, wall time also counts what the scheduler gave to others) and
the least one (the step least disturbed by the machine's other load), their ratios to the current code's, and the ATen
ops of a step (torch.profiler, deterministic).

The earlier forms are kept here only, as patches of the current code (each from before the block ops, so each also
runs the blocks by their modules):

- ``blocks: ops one by one``: each block's modules calling the ops one by one (site read, RMSNorm, the KDA layer's
  projections and core or DSA's projections, norms, RoPE, cache writes, indexer and attention, o_proj, stream write,
  the MoE layer: ~13 calls from Python per KDA block, ~40 per DSA block), instead of one op per block
  (ops/block_decode.py).
- ``site read: 2 ops``: the decode's site read as site_read + sinkhorn with the expansion of alpha, slices and views
  in Python (the training form's two ops), instead of the one op ``site_read_decode``.
- ``RoPE: eager``: the DSA indexer's rotations as the eager form (~14 ops a call), instead of the one op
  ``rotary_one``.
- ``linear: checks per call``: the decode's few-row linears through linear's general entry (fp32 wrapper, autocast,
  operand dtypes, grad, library asked per call) before the same panel_matmul, instead of its decode entry.
- ``MoE: ops one by one``: each MoE layer as its ops (router linear, sigmoid, routing, experts, shared expert: ~10
  dispatched ops with Python between them), instead of the one op ``moe_decode``.
- ``ops' entries per call``: every op through its general entry (autocast, dtype, library, op table and grad asked
  per call), instead of the decode step's direct C++ calls decided once per step (ops/decode.py).
- ``all of the above (f645ffb)``: every earlier form at once, with the mHC sites' parameters read through nn.Module
  attribute lookups and KDA's cached input weights looked up after its twelve module lookups: the decode step before
  this work (commit f645ffb).

    python -m benchmarks.bench_decode_forms [--rounds 30] [--padded 1]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.profile_step import is_aten
from glm_lightning.generation import decode_cache
from glm_lightning.model import GLMConfig, GLMModel
from glm_lightning.model.kda import KDAttention
from glm_lightning.model.mhc import HyperConnection
from glm_lightning.model.ops import decode, mhc as mhc_ops


def _site_read_two_ops(x, phi, alpha, bias, alpha_index, gate_scale, gate_shift, norm_eps, iters, eps):
    """The decode's site read before site_read_decode: the autograd form's two ops, called without autograd."""
    lead, (n, C) = x.shape[:-2], x.shape[-2:]
    h, gates, res_logits, *_ = torch.ops.glm_lightning.site_read(
        x.reshape(-1, n, C), phi, alpha.index_select(0, alpha_index), bias, gate_scale, gate_shift, norm_eps)
    res = torch.ops.glm_lightning.sinkhorn(res_logits, iters, eps)[0]
    return h.view(*lead, C), gates[:, n:].view(*lead, n), res.view(*lead, n, n)


_patched = mock.patch.object
"""_patched(module, name, value): the attribute replaced for a block (the standard library's patcher)."""


def _params_by_lookup(self: HyperConnection) -> tuple:
    return (self.phi, self.alpha, self.bias, self._alpha_index, self._gate_scale, self._gate_shift, self.norm_eps,
            self.iters, self.eps)


def _in_weights_after_lookups(self: KDAttention, cache) -> tuple[torch.Tensor, torch.Tensor]:
    qkv = (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
    small = (self.f_a_proj.weight, self.g_a_proj.weight, self.b_proj.weight)
    if cache is None or torch.is_grad_enabled():
        return torch.cat(qkv), torch.cat(small)
    return cache.in_weights  # set by the warm-up steps


@contextlib.contextmanager
def _both(*patches: contextlib.AbstractContextManager) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


BLOCKS = tuple(decode.ENTRY_PARTS)
"""The block ops' decode entries (ops/block_decode.py): off in every earlier form."""


def _entries_without(*ops: str) -> contextlib.AbstractContextManager:
    """The decode entries without ``ops`` and without the block ops."""
    return decode.without((*ops, *BLOCKS))


FORMS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "current": contextlib.nullcontext,
    "blocks: ops one by one": lambda: _entries_without(),
    "site read: 2 ops": lambda: _both(_patched(mhc_ops, "_site_read_no_grad", _site_read_two_ops),
                                      _entries_without("site_read")),
    "RoPE: eager": lambda: _entries_without("rotary"),
    "linear: checks per call": lambda: _entries_without("linear"),
    "MoE: ops one by one": lambda: _entries_without("moe_decode"),
    "ops' entries per call": lambda: _patched(decode, "OPS", ()),
    "all of the above (f645ffb)": lambda: _both(
        _patched(mhc_ops, "_site_read_no_grad", _site_read_two_ops), _patched(decode, "OPS", ()),
        _patched(HyperConnection, "_params", _params_by_lookup),
        _patched(KDAttention, "_in_weights", _in_weights_after_lookups)),
}


def run(rounds: int, rows: int = 16, prompt_len: int = 64, padded: int = 0) -> dict[str, dict[str, float]]:
    """{form: {"ms": median CPU ms of a step, "min_ms": the least, "ops": ATen ops of a step}}; ``padded``: that many
    rows of the step are padding (finished rows, as generation feeds them)."""
    torch.manual_seed(0)
    model = GLMModel(GLMConfig.preset("flash-25m")).eval()
    prompt = torch.randint(0, 256, (1, prompt_len))
    tok = torch.randint(0, 256, (rows, 1))
    valid = None if padded == 0 else torch.arange(rows)[:, None] >= padded
    times: dict[str, list[float]] = {name: [] for name in FORMS}
    ops: dict[str, int] = {}
    with torch.inference_mode():
        base = decode_cache(model, 1, prompt_len + 8)
        model(prompt, valid=torch.ones_like(prompt, dtype=torch.bool), cache=base)
        for _ in range(2):  # pack the weights, warm every form
            for form in FORMS.values():
                with form():
                    model(tok, valid=valid, cache=base.repeat_interleave(rows))
        for name, form in FORMS.items():
            cache = base.repeat_interleave(rows)
            with form(), profile(activities=[ProfilerActivity.CPU]) as prof:
                model(tok, valid=valid, cache=cache)
            ops[name] = sum(1 for e in prof.events() if is_aten(e.name))
        names = list(FORMS)
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                cache = base.repeat_interleave(rows)
                with FORMS[name]():
                    t = time.process_time()
                    model(tok, valid=valid, cache=cache)
                    times[name].append(time.process_time() - t)
    return {name: {"ms": statistics.median(times[name]) * 1e3, "min_ms": min(times[name]) * 1e3, "ops": ops[name]}
            for name in FORMS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--padded", type=int, default=0, help="rows of the step that are padding (finished rows)")
    args = p.parse_args()
    torch.set_num_threads(1)
    from glm_lightning import machine

    res = run(args.rounds, padded=args.padded)
    cur, cur_min = res["current"]["ms"], res["current"]["min_ms"]
    print(f"{machine.describe()}: flash-25m decode step, 16 rows ({args.padded} padded), CPU ms over {args.rounds} "
          "alternated rounds")
    print(f"{'form':<28}{'median':>8}{'x current':>11}{'min':>8}{'x current':>11}{'ATen ops':>10}")
    for name, r in res.items():
        print(f"{name:<28}{r['ms']:>8.2f}{r['ms'] / cur:>10.2f}x{r['min_ms']:>8.2f}{r['min_ms'] / cur_min:>10.2f}x"
              f"{r['ops']:>10}")


if __name__ == "__main__":
    main()
