"""C++ kernels of this tree against the same files at an older commit, alternated in one process at the flash-25m
training shapes, each call timed in the thread's CPU time: the KDA recurrence (csrc/kda_recurrent.cpp; 32 x 128, 6
heads of 32, checkpoints every 32 tokens) and the short conv + SiLU (csrc/short_conv.cpp; [32, 128, 576], 4 taps).
Each old file is compiled on its own (~1 min of g++), its ops registered under another namespace, so both kernels run
in the same process on the same tensors; their outputs are compared too.

    python -m benchmarks.bench_kernels_vs_commit [--rev db119f5] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from benchmarks.bench_vs_commit import ROOT
from glm_lightning.model import cext

BASE_REV = "db119f5"
"""main before issue 49 part 3's kernel passes (KDA state in L1, the short conv's token walk)."""
CSRC = "glm_lightning/model/csrc"


def build_old(rev: str, source: str, out_dir: Path) -> Any:
    """csrc/`source` and its headers at `rev`, compiled into one library whose ops are glm_lightning_old_<stem>::...;
    returns that op namespace."""
    ns = "glm_lightning_old_" + Path(source).stem
    for name in (source, "kernel_helpers.h", "lanes.h"):
        text = subprocess.run(["git", "show", f"{rev}:{CSRC}/{name}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout
        if name == source:
            text = text.replace("TORCH_LIBRARY_FRAGMENT(glm_lightning,", f"TORCH_LIBRARY_FRAGMENT({ns},")
            text = text.replace("TORCH_LIBRARY_IMPL(glm_lightning,", f"TORCH_LIBRARY_IMPL({ns},")
        (out_dir / name).write_text(text)
    lib = out_dir / f"{ns}.so"
    subprocess.run(["g++", *cext._compile_flags(), str(out_dir / source), "-o", str(lib), *cext._link_flags()],
                   check=True)
    torch.ops.load_library(str(lib))
    return getattr(torch.ops, ns)


def single_kernel_cli(doc: str, source: str, count: str, count_default: int) -> tuple[argparse.Namespace, Any]:
    """The command line of a benchmark of one C++ source against the same file at another commit (``--rev``,
    ``--rounds`` and its per-round ``--<count>``): the C++ ops checked, torch at 1 thread; (args, the old commit's
    ops built from `source` by :func:`build_old`)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--rev", default="HEAD")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument(f"--{count}", type=int, default=count_default)
    args = p.parse_args()
    if not cext.available():
        raise SystemExit("the C++ ops are not available")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        return args, build_old(args.rev, source, Path(tmp))


def kda_calls(lib: Any) -> dict[str, Callable[[], Any]]:
    """The KDA recurrence's forward and backward on a flash-25m layer's inputs (unit-norm keys, safe-range gates):
    contiguous, and as a training step lays them out ("step": q, k halves of one [B, T, 2H, K] tensor, v a slice of
    the short conv's [B, T, 3H, K] output, so a (row, head)'s tokens are 1,536 and 2,304 bytes apart); the step layout
    cycles over 4 input sets (~60 MB), so that its rows come from memory more than from the last call's cache."""
    B, T, H, K = 32, 128, 6, 32
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, K, generator=gen) * K ** -0.5
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, K, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    s0 = 0.1 * torch.randn(B, H, K, K, generator=gen)
    dO, dS = torch.randn(B, T, H, K, generator=gen), torch.randn(B, H, K, K, generator=gen)
    ck = lib.kda_recurrent_fwd(q, k, v, g, beta, s0, 32)[1]
    steps = []
    for _ in range(4):
        qk = torch.randn(B, T, 2 * H, K, generator=gen)
        sq, sk = qk.split(H, dim=2)
        sq.mul_(K ** -0.5)
        sk.copy_(F.normalize(sk, dim=-1))
        sv = torch.randn(B, T, 3 * H, K, generator=gen)[:, :, 2 * H:]
        sg = -5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen))
        sb = torch.sigmoid(torch.randn(B, T, H, generator=gen))
        sdo = torch.randn(B, T, H, K, generator=gen)
        steps.append((sq, sk, sv, sg, sb, sdo, lib.kda_recurrent_fwd(sq, sk, sv, sg, sb, s0, 32)[1]))
    turn = {"fwd": 0, "bwd": 0}

    def step(kind: str) -> Any:
        sq, sk, sv, sg, sb, sdo, sck = steps[turn[kind] % len(steps)]
        turn[kind] += 1
        if kind == "fwd":
            return lib.kda_recurrent_fwd(sq, sk, sv, sg, sb, s0, 32)
        return lib.kda_recurrent_bwd(sdo, dS, sq, sk, sv, sg, sb, sck, 32)

    return {"kda_recurrent fwd": lambda: lib.kda_recurrent_fwd(q, k, v, g, beta, s0, 32),
            "kda_recurrent bwd": lambda: lib.kda_recurrent_bwd(dO, dS, q, k, v, g, beta, ck, 32),
            "kda fwd (step)": lambda: step("fwd"), "kda bwd (step)": lambda: step("bwd")}


def conv_calls(lib: Any) -> dict[str, Callable[[], Any]]:
    """The short conv + SiLU forward and backward on a flash-25m layer's [32, 128, 3 x 192] projections."""
    gen = torch.Generator().manual_seed(0)
    x, dy = torch.randn(32, 128, 576, generator=gen), torch.randn(32, 128, 576, generator=gen)
    w = 0.5 * torch.randn(576, 4, generator=gen)
    return {"short_conv fwd": lambda: lib.short_conv_silu(x, w),
            "short_conv bwd": lambda: lib.short_conv_silu_backward(dy, x, w)}


KERNELS = {"kda_recurrent.cpp": kda_calls, "short_conv.cpp": conv_calls}


def _flat(out: Any) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def run(rev: str = BASE_REV, rounds: int = 15) -> dict[str, Any]:
    if not cext.available():
        print("C++ ops not available (GLM_LIGHTNING_EXT=0 or no compiler): nothing to compare")
        return {"available": False}
    res: dict[str, Any] = {"available": True, "rev": rev}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for source, calls_of in KERNELS.items():
            calls = {"old": calls_of(build_old(rev, source, Path(tmp))), "new": calls_of(torch.ops.glm_lightning)}
            for name in calls["new"]:
                old, new = calls["old"][name], calls["new"][name]
                diff = max((a - b).abs().max().item() for a, b in zip(_flat(old()), _flat(new())))
                times: dict[str, list[float]] = {"old": [], "new": []}
                for r in range(rounds):
                    for which in (("old", "new") if r % 2 == 0 else ("new", "old")):
                        t = time.thread_time()
                        (old if which == "old" else new)()
                        times[which].append(time.thread_time() - t)
                o_ms, n_ms = (statistics.median(times[w]) * 1e3 for w in ("old", "new"))
                res[name] = {"old_ms": o_ms, "new_ms": n_ms, "speedup": o_ms / n_ms, "max_diff": diff}
                rows.append((name, o_ms, n_ms, diff))
    print(f"flash-25m training shapes, {torch.get_num_threads()} thr, median of {rounds} alternated calls (thread CPU "
          f"time, output allocation included)")
    print(f"{'kernel':<20}{rev + ' ms':>12}{'this tree ms':>14}{'speed-up':>10}{'max |diff|':>12}")
    for name, o_ms, n_ms, diff in rows:
        print(f"{name:<20}{o_ms:>12.2f}{n_ms:>14.2f}{o_ms / n_ms:>9.2f}x{diff:>12.1e}")
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", default=BASE_REV)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    run(args.rev, args.rounds)


if __name__ == "__main__":
    main()
