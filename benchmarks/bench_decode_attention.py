"""A DSA layer's decode attention (csrc/decode_attention.cpp ``single_query_attention``, and the indexer's
``index_scores_one``: 4 heads of 32, no PyTorch form timed) of this tree against the same
file at an older commit and against the PyTorch form the op table may choose instead (ops/dsa.py: two bmm, scale,
mask, softmax), in turns in one process, each call timed in CPU time (1 thread): flash-25m's decode shapes, 16 rows
x 6 heads of 32 against 48..160 cached keys (strided slices of a longer cache, as the block op passes them). The two
C++ forms must agree bit for bit.

    python -m benchmarks.bench_decode_attention [--rev HEAD] [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.bench_kernels_vs_commit import single_kernel_cli


def aten_form(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """block_decode.cpp attention_aten's ATen calls (q [B, H, D], k and v [B, H, S, D], mask [B, S])."""
    B, H, D = q.shape
    S = k.shape[2]
    logits = torch.bmm(q.reshape(B * H, 1, D), k.reshape(B * H, S, D).transpose(1, 2)).view(B, H, 1, S)
    logits.mul_(D ** -0.5).masked_fill_(mask.logical_not().view(B, 1, 1, S), float("-inf"))
    return torch.bmm(torch.softmax(logits, -1).view(B * H, 1, S), v.reshape(B * H, S, D)).view(B, H, D)


def main() -> None:
    args, old = single_kernel_cli(__doc__, "decode_attention.cpp", "calls", 100)
    from glm_lightning import machine

    new = torch.ops.glm_lightning
    print(f"{machine.describe()}, 1 thread, {args.rounds} rounds of {args.calls} calls, medians of CPU time per call")
    gen = torch.Generator().manual_seed(0)
    B, H, D, cap = 16, 6, 32, 192
    kc, vc = torch.randn(B, H, cap, D, generator=gen), torch.randn(B, H, cap, D, generator=gen)
    for S in (48, 80, 160):
        q = torch.randn(B, H, D, generator=gen)
        k, v = kc[:, :, :S], vc[:, :, :S]
        mask = torch.rand(B, S, generator=gen) < (64 / S if S > 64 else 1.0)
        mask[:, -1] = True
        forms = {f"C++ {args.rev}": lambda: old.single_query_attention(q, k, v, mask, D ** -0.5),
                 "C++ this tree": lambda: new.single_query_attention(q, k, v, mask, D ** -0.5),
                 "PyTorch": lambda: aten_form(q, k, v, mask)}
        compare(forms, args, f"[{B} x {H} x {D}] against {S:3d} keys:")
        iq, iw, ik = torch.randn(B, 4, D, generator=gen), torch.rand(B, 4, generator=gen), kc[:, 0, :S]
        compare({f"C++ {args.rev}": lambda: old.index_scores_one(iq, iw, ik),
                 "C++ this tree": lambda: new.index_scores_one(iq, iw, ik)}, args, f"index scores, {S:3d} keys:")


def compare(forms: dict, args: argparse.Namespace, label: str) -> None:
    """Time the forms in turns (the order reversed every other round) and print their medians and ratios."""
    a, b = (f() for f in list(forms.values())[:2])
    assert torch.equal(a, b), "the C++ forms differ"
    times: dict[str, list[float]] = {name: [] for name in forms}
    for r in range(args.rounds):
        for name, f in (forms.items() if r % 2 == 0 else reversed(forms.items())):
            t = time.process_time()
            for _ in range(args.calls):
                f()
            times[name].append((time.process_time() - t) / args.calls)
    base = statistics.median(times["C++ this tree"])
    cells = "  ".join(f"{name} {statistics.median(ts) * 1e6:7.1f} us ({statistics.median(ts) / base:4.2f}x)"
                      for name, ts in times.items())
    print(f"{label} {cells}", flush=True)


if __name__ == "__main__":
    main()
