"""The C++ KDA recurrence (csrc/kda_recurrent.cpp) of this tree against the same file at an older commit, forward and
backward alternated in one process at the flash-25m training shapes (32 x 128, 6 heads of 32, checkpoints every 32
tokens), each call timed in the thread's CPU time. The old file is compiled on its own (~1 min of g++), its ops
registered under another namespace, so both kernels run in the same process on the same tensors; their outputs are
compared too (the forward is bit for bit the same math, the backward groups its FMAs differently).

    python -m benchmarks.bench_kda_vs_commit [--rev db119f5] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.bench_vs_commit import ROOT
from glm_lightning.model import cext

BASE_REV = "db119f5"
"""main before the KDA recurrence kept its state in memory (issue 49 part 3)."""
CSRC = "glm_lightning/model/csrc"
SHAPE = (32, 128, 6, 32)
"""(B, T, H, K = V) of a flash-25m training step."""


def build_old(rev: str, out_dir: Path) -> Any:
    """kda_recurrent.cpp and its headers at `rev`, compiled into one library whose ops are glm_lightning_old::...;
    returns that op namespace."""
    for name in ("kda_recurrent.cpp", "kernel_helpers.h", "lanes.h"):
        text = subprocess.run(["git", "show", f"{rev}:{CSRC}/{name}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout
        if name.endswith(".cpp"):
            text = text.replace("TORCH_LIBRARY_FRAGMENT(glm_lightning,", "TORCH_LIBRARY_FRAGMENT(glm_lightning_old,")
            text = text.replace("TORCH_LIBRARY_IMPL(glm_lightning,", "TORCH_LIBRARY_IMPL(glm_lightning_old,")
        (out_dir / name).write_text(text)
    lib = out_dir / "kda_old.so"
    subprocess.run(["g++", *cext._compile_flags(), str(out_dir / "kda_recurrent.cpp"), "-o", str(lib),
                    *cext._link_flags()], check=True)
    torch.ops.load_library(str(lib))
    return torch.ops.glm_lightning_old


def inputs() -> list[torch.Tensor]:
    """q, k, v, g, beta, S0, dO, dS_last as a training step gives them (unit-norm keys, gates in the safe range)."""
    B, T, H, K = SHAPE
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, K, generator=gen) * K ** -0.5
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, K, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    s0 = 0.1 * torch.randn(B, H, K, K, generator=gen)
    return [q, k, v, g, beta, s0, torch.randn(B, T, H, K, generator=gen), torch.randn(B, H, K, K, generator=gen)]


def run(rev: str = BASE_REV, rounds: int = 15) -> dict[str, Any]:
    if not cext.available():
        print("C++ ops not available (GLM_LIGHTNING_EXT=0 or no compiler): nothing to compare")
        return {"available": False}
    libs = {"new": torch.ops.glm_lightning}
    with tempfile.TemporaryDirectory() as tmp:
        libs = {rev: build_old(rev, Path(tmp)), **libs}
    q, k, v, g, beta, s0, dO, dS = inputs()
    seg = 32
    outs = {}
    for name, lib in libs.items():
        o, ck = lib.kda_recurrent_fwd(q, k, v, g, beta, s0, seg)
        outs[name] = (o, *lib.kda_recurrent_bwd(dO, dS, q, k, v, g, beta, ck, seg))
    diffs = [(a - b).abs().max().item() for a, b in zip(*outs.values())]
    print("max |old - new|: " + ", ".join(f"{n} {d:.1e}" for n, d in
                                          zip(("o", "dq", "dk", "dv", "dg", "dbeta", "dS0"), diffs)))
    times: dict[tuple[str, str], list[float]] = {(n, p): [] for n in libs for p in ("fwd", "bwd")}
    for r in range(rounds):
        for name in (libs if r % 2 == 0 else list(libs)[::-1]):
            lib = libs[name]
            t = time.thread_time()
            _, ck = lib.kda_recurrent_fwd(q, k, v, g, beta, s0, seg)
            times[name, "fwd"].append(time.thread_time() - t)
            t = time.thread_time()
            lib.kda_recurrent_bwd(dO, dS, q, k, v, g, beta, ck, seg)
            times[name, "bwd"].append(time.thread_time() - t)
    B, T, H, K = SHAPE
    print(f"kda_recurrent, {B} x {T}, {H} heads of {K}, {torch.get_num_threads()} thr, median of {rounds} alternated "
          f"calls (thread CPU time)")
    print(f"{'direction':<10}{rev + ' ms':>14}{'this tree ms':>14}{'speed-up':>10}")
    res: dict[str, Any] = {"available": True, "rev": rev, "max_diff": diffs}
    for p in ("fwd", "bwd"):
        old, new = (statistics.median(times[n, p]) * 1e3 for n in libs)
        res[p] = {"old_ms": old, "new_ms": new, "speedup": old / new}
        print(f"{p:<10}{old:>14.2f}{new:>14.2f}{old / new:>9.2f}x")
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", default=BASE_REV)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    run(args.rev, args.rounds)


if __name__ == "__main__":
    main()
