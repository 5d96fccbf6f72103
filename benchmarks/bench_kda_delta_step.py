"""KDA's decode delta step (csrc/kda_decode.cpp ``delta_step_``: the recurrent state's decay, read, delta update and
output for one token) of this tree against the same file at an older commit, in turns in one process, CPU time, 1
thread: flash-25m's decode, 16 rows x 6 heads, a [32 x 32] fp32 state per head (4 KB: one page each), the states
cold (the call cycles through ~80 MB of copies, as a decode step finds them after streaming the model's weights).
The two forms must agree bit for bit.

    python -m benchmarks.bench_kda_delta_step [--rev HEAD] [--rounds 9]
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.bench_kernels_vs_commit import single_kernel_cli


def main() -> None:
    args, old = single_kernel_cli(__doc__, "kda_decode.cpp", "copies", 200)
    from glm_lightning import machine

    libs = {f"C++ {args.rev}": old, "C++ this tree": torch.ops.glm_lightning}
    B, H, K = 16, 6, 32
    gen = torch.Generator().manual_seed(0)
    states = [0.1 * torch.randn(B, H, K, K, generator=gen) for _ in range(args.copies)]
    q, v = torch.randn(B, H, K, generator=gen), torch.randn(B, H, K, generator=gen)
    k = F.normalize(torch.randn(B, H, K, generator=gen), dim=-1)
    g, beta = -0.1 * torch.rand(B, H, K, generator=gen), torch.rand(B, H, generator=gen)
    outs = []
    for lib in libs.values():
        S = states[0].clone()
        outs.append((lib.delta_step_(q, k, v, g, beta, S), S))
    assert all(torch.equal(a, b) for a, b in zip(*outs)), "the forms differ"
    times: dict[str, list[float]] = {name: [] for name in libs}
    for r in range(args.rounds):
        for name, lib in (libs.items() if r % 2 == 0 else reversed(libs.items())):
            t = time.process_time()
            for S in states:
                lib.delta_step_(q, k, v, g, beta, S)
            times[name].append((time.process_time() - t) / args.copies)
    base = statistics.median(times["C++ this tree"])
    print(f"{machine.describe()}, 1 thread, {args.rounds} rounds, medians of CPU time per call, {B} rows x {H} heads "
          f"of [{K} x {K}], states cold")
    for name, ts in times.items():
        print(f"{name:14s} {statistics.median(ts) * 1e6:7.1f} us ({statistics.median(ts) / base:4.2f}x)")


if __name__ == "__main__":
    main()
