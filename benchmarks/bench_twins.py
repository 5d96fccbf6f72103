"""With the C++ ops off (another device, GLM_LIGHTNING_EXT=0), does a PyTorch twin with a hand-written backward earn
its keep against the reference form with autograd? Study-model training steps (fwd + bwd) with each twin swapped for
its reference, alternated in one process, median seconds per step and ATen ops per step.

    python -m benchmarks.bench_twins [--rounds 5] [--steps 3]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace
from unittest import mock

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from benchmarks.profile_step import build, count_aten_ops
from glm_lightning.model import ops
from glm_lightning.model.ops import kda_chunkwise, mhc, reference

kda_sequence = importlib.import_module("glm_lightning.model.ops.kda_sequence")
"""The module (``ops.kda_sequence`` is its function): the names the KDA layer's T-token op looks up."""


def _chunked_autograd(q, k, v, g, beta, chunk_size=32, initial_state=None, *, gate_bound=None, cpp=None):
    """The chunked form's forward with autograd recording it (no hand-written backward)."""
    B, _, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state
    ns = kda_chunkwise._n_row_blocks(chunk_size, abs(gate_bound or 5.0))
    ctx = SimpleNamespace(save_for_backward=lambda *a: None)
    with mock.patch.object(kda_chunkwise, "scan", _scan_autograd):
        return kda_chunkwise._KDAChunked.forward(ctx, q, k, v, g, beta, S, chunk_size, ns, False)


def _scan_autograd(P, R, S0, cpp):
    states = [S0]
    for n in range(P.shape[0]):
        states.append(torch.baddbmm(R[n], P[n], states[-1]))
    return torch.stack(states)


SWAPS = {
    "(no swap: noise control)": [],
    "sinkhorn": [(mhc, "sinkhorn", reference.sinkhorn_knopp)],
    "kda_chunked": [(kda_sequence, "kda_core", _chunked_autograd)],
}
"""Each kept twin and what replaces it: the reference form, with autograd doing the backward; the control swaps
nothing, so its ratio is the sitting's noise. (The KDA features', RMSNorm's, the stream write's and the gated head
norm's twins measured within that noise and went: their ops run the reference forms without the C++ ops.)"""


@contextmanager
def swapped(name: str | None) -> Iterator[None]:
    with ops.cpp_ops(False), ExitStack() as stack:
        for target, attr, value in SWAPS.get(name, []):
            stack.enter_context(mock.patch.object(target, attr, value))
        yield


def step(model, ids) -> None:
    out = model(ids[:, :-1])
    loss = F.cross_entropy(out.logits.flatten(0, 1), ids[:, 1:].flatten()) + out.aux_loss
    loss.backward()
    model.zero_grad(set_to_none=True)


def op_count(model, ids) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(model, ids)
    return count_aten_ops(prof)["total"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--model", default="study")
    args = p.parse_args()
    model, B, T = build(args.model)
    ids = torch.randint(0, 256, (B, T + 1), generator=torch.Generator().manual_seed(0))
    names = [None, *SWAPS]
    times: dict[str | None, list[float]] = {n: [] for n in names}
    for n in names:
        with swapped(n):
            step(model, ids)  # warm-up
    for _ in range(args.rounds):
        for n in names:
            with swapped(n):
                t = time.perf_counter()
                for _ in range(args.steps):
                    step(model, ids)
                times[n].append((time.perf_counter() - t) / args.steps)
    base = statistics.median(times[None])
    print(f"{args.model} model, C++ ops off, {torch.get_num_threads()} threads, median of {args.rounds} rounds")
    print(f"{'twin replaced by its reference':32s} {'s/step':>8s} {'vs twins':>9s} {'ATen ops':>9s}")
    for n in names:
        with swapped(n):
            count = op_count(model, ids)
        med = statistics.median(times[n])
        print(f"{n or '(all twins)':32s} {med:8.3f} {med / base:8.2f}x {count:9d}")


if __name__ == "__main__":
    main()
