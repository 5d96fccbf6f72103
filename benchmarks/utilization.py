"""How close a benchmark runs to this machine's own limits (issue 49): the peaks it measures and the arithmetic that
turns a rate into a fraction of them.

The limits, each measured here, at the thread count the benchmark runs with:

- **GEMM peak**: the best rate of an n x n x n ``torch.mm`` (fp32; bf16 too where the CPU has native bf16,
  avx512_bf16 or AMX: glm_lightning/precision.py), GFLOP/s = 2 n^3 / seconds.
- **Read bandwidth**: the best rate of a ``sum`` over a buffer of a given size (GB/s = bytes / seconds). The decode
  bound reads a buffer of the size a decode step reads, so a step whose weights fit the cache is measured against the
  cache's bandwidth, not the DRAM's.

The arithmetic (every count written down so a reader can redo it):

- **Training MFU** = model FLOPs per second / GEMM peak, with ``6 x active parameters`` FLOPs per token (2 forward, 4
  backward per weight; active: the routed experts counted top_k / n_experts; the embedding table counted as a weight).
  Attention's own products (q k^T and p v, which have no weights) are NOT included: bench_train prints the share they
  would add (:func:`attention_flops_per_token`; at flash-25m's 128 tokens, 3 DSA layers and top-64 keys, ~0.3%).
- **Decode compute bound** (tokens/s): a decode step of R rows does 2 x active parameters x R FLOPs, so at the peak
  it makes R tokens in ``2 x active x R / peak`` seconds: ``peak / (2 x active)`` tokens/s, whatever R is.
- **Decode bandwidth bound** (tokens/s): R tokens per ``bytes read per step / bandwidth`` seconds. Bytes read per step
  (:func:`decode_bytes_per_step`): every weight that the step multiplies, once (the routed experts that at least one
  of the R rows picks, expected under uniform routing: E (1 - (1 - k/E)^R) of E per layer), plus the caches: each
  KDA layer's state and conv buffer read and written, each DSA layer's cached keys, values and indexer keys read up to
  the mean cache length of the run.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

from glm_lightning import machine, precision

TRAIN_FLOPS = "6 x active parameters per token (attention's q k^T and p v not included)"
DECODE_FLOPS = "2 x active parameters x rows per decode step (attention not included)"


# --- the arithmetic (no timing: tests/test_bench_utilization.py checks it on made-up numbers) -----------------------
def train_flops_per_token(active_params: int) -> float:
    """Model FLOPs of one training token: 6 x active parameters."""
    return 6.0 * active_params


def mfu(tokens_per_s: float, flops_per_token: float, peak_gflops: float) -> float:
    """Model FLOPs utilisation: tokens/s x FLOPs per token over the peak (GFLOP/s)."""
    return tokens_per_s * flops_per_token / (peak_gflops * 1e9)


def attention_flops_per_token(n_layers_attn: int, n_heads: int, head_dim: int, keys: float) -> float:
    """Training FLOPs per token of attention's weightless products (q k^T and p v: 2 x 2 x H x D x keys forward,
    twice that backward), the part :data:`TRAIN_FLOPS` leaves out."""
    return 3 * 4.0 * n_layers_attn * n_heads * head_dim * keys


def decode_compute_bound(active_params: int, peak_gflops: float) -> float:
    """Tokens/s a decode loop would make at the GEMM peak: 2 x active FLOPs per token (any number of rows)."""
    return peak_gflops * 1e9 / (2.0 * active_params)


def decode_bandwidth_bound(bytes_per_step: float, rows: int, bandwidth_gbs: float) -> float:
    """Tokens/s a decode loop would make if each step took only the time to read its bytes: rows per step over
    bytes / bandwidth seconds."""
    return rows * bandwidth_gbs * 1e9 / bytes_per_step


def experts_touched(n_experts: int, top_k: int, rows: int) -> float:
    """Expected routed experts of one layer that at least one of ``rows`` tokens picks, under uniform routing."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** rows)


def decode_bytes_per_step(total_params: int, routed_params: int, n_experts: int, top_k: int, rows: int,
                          cache_bytes: float, bytes_per_param: int = 4) -> float:
    """Bytes one decode step of ``rows`` rows reads: the weights (the routed experts' share scaled to the experts
    that the rows pick, :func:`experts_touched`) plus ``cache_bytes`` (the caches' reads and writes)."""
    routed_read = routed_params * experts_touched(n_experts, top_k, rows) / n_experts if n_experts else 0.0
    return (total_params - routed_params + routed_read) * bytes_per_param + cache_bytes


def model_decode_bytes(model: Any, rows: int, mean_length: float) -> dict[str, float]:
    """:func:`decode_bytes_per_step` for a GLMModel's decode step of ``rows`` rows at a mean cache length: the weights
    in their stored dtype, each KDA cache read and written, each DSA cache's keys/values/indexer keys read up to
    ``mean_length``."""
    cfg = model.cfg
    total = sum(p.numel() for p in model.parameters())
    routed = cfg.n_layers * cfg.n_experts * 3 * cfg.d_model * cfg.expert_hidden if cfg.ffn == "moe" else 0
    cache = model.new_cache(rows)
    cache_bytes = 0.0
    for layer in cache.layers:
        if hasattr(layer, "state"):  # KDA: the state and the conv buffer, read and written
            cache_bytes += 2 * (layer.state.nbytes + layer.conv_state.nbytes)
        else:  # DSA: keys, values and indexer keys read up to the mean length
            frac = min(1.0, mean_length / layer.k.shape[2])
            cache_bytes += frac * (layer.k.nbytes + layer.v.nbytes + layer.index_k.nbytes)
    weight_bytes = next(model.parameters()).element_size()
    n_experts, top_k = (cfg.n_experts, cfg.moe_top_k) if cfg.ffn == "moe" else (0, 0)
    return {"bytes": decode_bytes_per_step(total, routed, n_experts, top_k, rows, cache_bytes, weight_bytes),
            "cache_bytes": cache_bytes, "experts_touched": experts_touched(n_experts, top_k, rows) if n_experts else 0}


# --- the measurements ---------------------------------------------------------------------------------------------
def gemm_peak_gflops(dtype: torch.dtype = torch.float32, n: int = 1536, reps: int = 8) -> float:
    """Best-of rate (GFLOP/s) of an n x n x n ``torch.mm`` in ``dtype`` at the current thread count."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * n ** 3 / (time.perf_counter() - t) / 1e9)
    return best


def read_bandwidth_gbs(nbytes: float, reps: int = 10) -> float:
    """Best-of rate (GB/s) of reading an fp32 buffer of ``nbytes`` (one ``sum``; warmed first, so a buffer that
    fits the caches is read from them)."""
    buf = torch.ones(max(1, int(nbytes) // 4))
    buf.sum()
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        buf.sum()
        best = max(best, buf.nbytes / (time.perf_counter() - t) / 1e9)
    return best


@functools.lru_cache(maxsize=None)
def peaks(threads: int, quick: bool = False) -> dict[str, float | None]:
    """This machine's GEMM peaks at ``threads`` threads (the caller sets them; the argument keys the cache): fp32,
    and bf16 where the CPU has native bf16 (else None: torch's bf16 kernel is then a slow reference loop)."""
    reps = 3 if quick else 8
    out: dict[str, float | None] = {"fp32": gemm_peak_gflops(torch.float32, 1536, reps), "bf16": None}
    if precision.native_bf16():
        out["bf16"] = gemm_peak_gflops(torch.bfloat16, 1536, reps)
    return out


def machine_fields() -> dict[str, Any]:
    """What every row names: CPU model, torch's CPU capability, the thread count (glm_lightning.machine)."""
    info = machine.machine_info()
    return {"cpu": info["cpu"], "cpu_capability": info["cpu_capability"], "threads": info["threads"],
            "machine": machine.describe(info)}


def format_fraction(rate: float, bound: float) -> str:
    return f"{rate / bound:.1%} of {bound:,.0f}"
