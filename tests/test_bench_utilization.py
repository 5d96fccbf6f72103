"""The utilization arithmetic of `make bench` (benchmarks/utilization.py) on made-up numbers, worked by hand: MFU,
the decode compute and bandwidth bounds, the bytes a decode step reads, and the summary rows naming their machine.
Nothing here is timed."""

from __future__ import annotations

import pytest
import torch

import benchmarks.__main__ as bench
from benchmarks import utilization as u
from glm_lightning.model import GLMConfig, GLMModel


def test_training_mfu_is_six_flops_per_active_parameter_over_the_peak():
    assert u.train_flops_per_token(10_000_000) == 60_000_000
    # 1,000 tok/s x 60 MFLOP/token = 60 GFLOP/s of a 100 GFLOP/s peak
    assert u.mfu(1_000, 60e6, 100.0) == pytest.approx(0.6)
    assert u.mfu(500, 60e6, 100.0) == pytest.approx(0.3)


def test_attention_flops_are_twelve_h_d_keys_per_layer():
    # fwd q k^T and p v: 2 x 2 x H x D x keys; bwd twice that: 12 x 6 x 32 x 48 per layer, 3 layers
    assert u.attention_flops_per_token(3, 6, 32, 48.0) == 3 * 12 * 6 * 32 * 48


def test_decode_bounds():
    # 2 x 1M FLOPs per token at 100 GFLOP/s: 50,000 tok/s, whatever the rows
    assert u.decode_compute_bound(1_000_000, 100.0) == pytest.approx(50_000)
    # 16 rows per step, 100 MB per step at 10 GB/s: a step in 10 ms, 1,600 tok/s
    assert u.decode_bandwidth_bound(100e6, 16, 10.0) == pytest.approx(1_600)
    assert u.decode_bandwidth_bound(100e6, 32, 10.0) == pytest.approx(3_200)


def test_experts_touched_and_bytes_per_step():
    assert u.experts_touched(8, 2, 1) == pytest.approx(2)
    assert u.experts_touched(8, 2, 2) == pytest.approx(8 * (1 - 0.75 ** 2))  # 3.5
    assert u.experts_touched(8, 8, 3) == pytest.approx(8)
    # 1,000 weights of which 800 routed, 1 row picks 2 of 8 experts: 200 + 200 weights read, fp32, + 100 cache bytes
    assert u.decode_bytes_per_step(1_000, 800, 8, 2, 1, 100.0) == pytest.approx(1_700)
    assert u.decode_bytes_per_step(1_000, 800, 8, 2, 1, 100.0, bytes_per_param=2) == pytest.approx(900)


def test_model_decode_bytes_counts_the_tiny_model_by_hand():
    torch.manual_seed(0)
    model = GLMModel(GLMConfig.preset("tiny"))
    cfg = model.cfg
    rows, mean = 3, 10.0
    routed = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("moe.w_gate_up", "moe.w_down")))
    total = sum(p.numel() for p in model.parameters())
    H, K, ks = cfg.n_heads, cfg.head_dim, cfg.kda_conv_size
    kda = 2 * 4 * rows * (H * K * K + (ks - 1) * 3 * H * K)  # state and conv buffer, read and written, fp32
    dsa = 4 * rows * mean * (2 * cfg.n_kv_heads * cfg.head_dim + cfg.index_head_dim)  # k, v, indexer keys
    n_kda, n_dsa = cfg.layer_kinds.count("L"), cfg.layer_kinds.count("S")
    touched = cfg.n_experts * (1 - (1 - cfg.moe_top_k / cfg.n_experts) ** rows)
    expect = 4 * (total - routed + routed * touched / cfg.n_experts) + n_kda * kda + n_dsa * dsa
    got = u.model_decode_bytes(model, rows, mean)
    assert got["cache_bytes"] == pytest.approx(n_kda * kda + n_dsa * dsa)
    assert got["bytes"] == pytest.approx(expect)


def test_summary_rows_name_the_machine_and_the_fractions():
    machine = "Some CPU [AVX2], 1 thread, torch 2.x"
    train = {"threads": 1, "machine": machine, "peak_gflops": 80.0, "hybrid_over_dense": 0.9,
             "hybrid flash-25m": {"tokens_per_s": 700, "mfu": 0.33, "peak_rss_mb": 3000},
             "dense baseline": {"tokens_per_s": 800, "mfu": 0.4, "peak_rss_mb": 2000}}
    gen = {"machine": machine, "cached_tokens_per_s": 280, "naive_tokens_per_s": 14, "speedup": 20.0,
           "peak_rss_mb": 900, "compute_bound_tokens_per_s": 3788, "compute_bound_fraction": 280 / 3788,
           "peak_gflops": 80.0, "bandwidth_bound_tokens_per_s": 560, "bandwidth_bound_fraction": 0.5,
           "bytes_per_step": 120e6, "bandwidth_gbs": 4.2}
    rows = bench.summary_rows({"train": train, "generation": gen})
    assert rows and all(r[3] == machine for r in rows)
    text = "\n".join(r[1] for r in rows)
    assert "MFU 33.0% of the fp32 GEMM peak 80 GFLOP/s" in text
    assert "7.4% of the compute bound (3,788 tok/s" in text and "50.0% of the bandwidth bound (560 tok/s" in text


def test_summary_rows_of_a_native_bf16_run():
    """On a CPU with native bf16 the bf16 benchmark times native bf16 at the full size: its rows read that size."""
    machine = "Some CPU [AVX512], 1 thread, torch 2.x"
    row = {"s_per_step": 1.0, "tokens_per_s": 100.0, "mfu": 0.25}
    b = {"machine": machine, "native_bf16": True, "batch": 32, "seq": 128, "native_batch": 32,
         "peak_gflops": {"fp32": 90.0, "native": 900.0, "emulated": 60.0},
         "train": {"fp32 32x128": row, "emulated 32x128": row, "native 32x128": {**row, "mfu": 0.05}},
         "train_emulated_over_fp32": 0.9, "train_native_over_fp32": 1.3,
         "generation": {m: {"tokens_per_s": 200.0} for m in ("fp32", "bf16")}, "generation_bf16_over_fp32": 1.1}
    rows = bench.summary_rows({"bf16": b})
    assert all(r[3] == machine for r in rows)
    text = "\n".join(r[1] for r in rows)
    assert "fp32 25.0% of the fp32 peak, bf16-mixed 5.0% of the bf16 peak" in text
    assert "32x128: native 1.30x fp32" in text


@pytest.mark.parametrize("cpp", [False, pytest.param(True, marks=pytest.mark.skipif(
    not __import__("glm_lightning.model.cext", fromlist=["available"]).available(), reason="C++ ops not built"))])
def test_time_decode_splits_a_step_and_puts_the_matmuls_back(cpp, monkeypatch):
    """profile_decode.time_decode on the tiny model: with the C++ ops it counts the few-row matmul calls of a step
    (panel_matmul on the decode's packed weights) and the weight bytes they read (at most every matrix once), without
    them none; the ops it wraps are restored after."""
    from benchmarks.profile_decode import time_decode
    from glm_lightning.model import ops
    from glm_lightning.model.ops import matmul, moe, thresholds

    monkeypatch.setattr(thresholds, "SMALL_ROWS", 32)  # the AVX-512 table's values (0 on AVX2: BLAS always)
    monkeypatch.setattr(thresholds, "SMALL_TOKENS", 64)
    inner = (matmul.small_matmul, moe.small_matmul, matmul.panel_matmul)
    with ops.cpp_ops(cpp):
        r = time_decode(rows=4, steps=2, prompt_len=8, preset="tiny")
    assert (matmul.small_matmul, moe.small_matmul, matmul.panel_matmul) == inner
    assert r["step_s"] > 0 and r["matmul_s"] >= 0
    if not cpp:
        assert r["matmul_calls"] == 0 and r["matmul_bytes"] == 0
        return
    model = GLMModel(GLMConfig.preset("tiny"))
    matrices = sum(p.nbytes for p in model.parameters() if p.dim() >= 2)
    assert r["matmul_calls"] >= model.cfg.n_layers  # at least the experts of every layer
    assert 0 < r["matmul_bytes"] <= matrices
