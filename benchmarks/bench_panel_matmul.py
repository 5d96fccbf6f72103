"""The decode's few-row matmul forms on flash-25m's weight shapes, each weight cold (the forms cycle through copies
of it, ~90 MB, as a decode step streams the whole model): ``small_matmul`` on W [out, in] as stored, BLAS
``mm(x, W.t())``, BLAS ``mm`` on a contiguous transposed copy W^T [in, out], ``panel_matmul`` on W packed into output
panels (csrc/panel_matmul.cpp), and a plain ``sum`` over the same bytes (the read rate the forms are held to). The
forms take turns; best of the rounds, microseconds per call and GB/s of weights.

    python -m benchmarks.bench_panel_matmul [--rounds 5] [--threads 1] [--rows 1,4,16]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from glm_lightning.model import GLMConfig, cext

COLD_BYTES = 90e6
"""Bytes of weight copies each form cycles through (well above this machine's caches)."""


def shapes(cfg: GLMConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of the decode's matrices: the KDA layer's fused q|k|v, its output, the experts' fused gate|up and down
    (the shared expert's too) and the head."""
    HK = cfg.n_heads * cfg.head_dim
    return {"KDA q|k|v": (3 * HK, cfg.d_model), "KDA / DSA out": (cfg.d_model, HK),
            "expert gate|up": (2 * cfg.expert_hidden, cfg.d_model), "expert down": (cfg.d_model, cfg.expert_hidden),
            "head": (cfg.vocab_size, cfg.d_model)}


def forms(x: torch.Tensor, out: int, copies: int) -> dict[str, Callable[[int], torch.Tensor]]:
    """name -> call on the i-th copy of a [out, x.shape[1]] weight."""
    n_in = x.shape[1]
    gen = torch.Generator().manual_seed(0)
    W = [torch.randn(out, n_in, generator=gen) * n_in ** -0.5 for _ in range(copies)]
    Wt = [w.t().contiguous() for w in W]
    P = [torch.ops.glm_lightning.panel_pack(w) for w in W]
    return {"small_matmul": lambda i: torch.ops.glm_lightning.small_matmul(x, W[i]),
            "mm(x, W.t())": lambda i: torch.mm(x, W[i].t()),
            "mm(x, W^T copy)": lambda i: torch.mm(x, Wt[i]),
            "panel_matmul": lambda i: torch.ops.glm_lightning.panel_matmul(x, P[i], out),
            "read (sum)": lambda i: W[i].sum()}


def measure(rows: int, out: int, n_in: int, rounds: int) -> dict[str, float]:
    """Best seconds per call of each form for ``rows`` rows against a cold [out, n_in] weight."""
    copies = max(8, int(COLD_BYTES // (out * n_in * 4)))
    x = torch.randn(rows, n_in)
    fs = forms(x, out, copies)
    best = {name: float("inf") for name in fs}
    for _ in range(rounds):
        for name, f in fs.items():
            t = time.perf_counter()
            for i in range(copies):
                f(i)
            best[name] = min(best[name], (time.perf_counter() - t) / copies)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", default="1,4,16")
    args = p.parse_args()
    if not cext.available():
        raise SystemExit("the C++ ops are not available")
    torch.set_num_threads(args.threads)
    from glm_lightning import machine

    print(f"{machine.describe()}, {args.threads} thread(s), best of {args.rounds} rounds, weights cold "
          f"(~{COLD_BYTES / 1e6:.0f} MB of copies cycled); us per call (GB/s of weights)")
    for label, (out, n_in) in shapes(GLMConfig.preset("flash-25m")).items():
        for rows in (int(r) for r in args.rows.split(",")):
            best = measure(rows, out, n_in, args.rounds)
            nbytes = out * n_in * 4
            cells = "  ".join(f"{name} {s * 1e6:6.1f} ({nbytes / s / 1e9:4.1f})" for name, s in best.items())
            print(f"{label:15s} [{out:3d} x {n_in:3d}] {rows:2d} rows: {cells}", flush=True)


if __name__ == "__main__":
    main()
