"""fp32 against bf16 in one run: the matmul peaks (fp32, torch's native bf16 kernel, the emulated bf16 GEMM), training
throughput of flash-25m (fwd + bwd + AdamW) in fp32 and bf16-mixed, and cached generation (16 samples x 48 tokens)
from fp32 and from bf16 weights (``--generation``: those rows alone, taking turns). Whether this CPU has native bf16
is printed first (glm_lightning/precision.py).

bf16 has two kernels here (glm_lightning/model/ops/mixed_precision.py): ``native`` (torch's bf16 kernels: fast on a
CPU with avx512_bf16 / amx_bf16, a slow reference loop elsewhere) and ``emulated`` (fp32 GEMMs on bf16-rounded
operands: bf16's numerics at about fp32 speed). Emulated bf16 is timed at the full size against fp32, taking turns;
native bf16 at a smaller batch (``native_batch``, its own fp32 row beside it), because on a CPU without native bf16 a
full-size step takes minutes; on a CPU with native bf16 (avx512_bf16 or AMX) native bf16 runs at the full size. Every comparison takes turns (an untimed run, then a timed one, per turn; the median),
so that load changes on a shared machine hit each row alike. MFU: bf16 rows against the bf16 peak measured here, fp32 rows against the fp32 peak.

    python -m benchmarks.bench_bf16 [--quick] [--generation [--rounds 5]]
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from benchmarks import utilization
from benchmarks.bench_train import hybrid_loss, make_step
from glm_lightning import precision
from glm_lightning.generation import generate
from glm_lightning.model import GLMConfig, GLMModel, cext, ops
from glm_lightning.model.ops import mixed_precision as mp


def gemm_peak_gflops(kind: str, n: int, reps: int) -> float:
    """Best-of GEMM rate (GFLOP/s) of an n x n x n product: ``fp32``, ``native`` (torch's bf16 kernel on bf16
    tensors) or ``emulated`` (mixed_precision.mm on bf16 tensors: upcasts, an fp32 GEMM, the rounding)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    if kind != "fp32":
        a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
    fn: Callable[[], torch.Tensor]
    if kind == "emulated":
        def fn() -> torch.Tensor:
            with mp.bf16_gemm("emulated"):
                return mp.mm(a, b)
    else:
        def fn() -> torch.Tensor:
            return torch.mm(a, b)
    fn()
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = max(best, 2 * n ** 3 / (time.perf_counter() - t) / 1e9)
    return best


def _in_mode(mode: str, step: Callable[[], float]) -> Callable[[], float]:
    """The step run in fp32 (mode ``fp32``) or under bf16 autocast with the given bf16 GEMM kernel."""
    def run() -> float:
        ctx = (nullcontext(), nullcontext()) if mode == "fp32" else (mp.bf16_gemm(mode),
                                                                    torch.autocast("cpu", torch.bfloat16))
        with ctx[0], ctx[1]:
            return step()
    return run


def _median_in_turns(steps: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Median seconds per step, the rows taking turns (one untimed step, then one timed, per turn)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            step()
            times[name].append(step())
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def _generation(model: GLMModel, precision_: str, samples: int, new_tokens: int) -> Callable[[], float]:
    """A function that runs one cached generation (a 64-token prompt, ``samples`` x ``new_tokens``) at ``precision``
    "32" (the fp32 weights) or "bf16" (generation.sampling_weights' copy: fp32 compute, its decode reading bf16
    panels; no bf16 GEMM, so the bf16 GEMM kernel does not matter) and returns its CPU seconds (process time: the
    machine may be shared; 1 thread)."""
    prompt = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(0))

    def run() -> float:
        t = time.process_time()
        generate(model, prompt, max_new_tokens=new_tokens, num_samples=samples, temperature=1.0, eos_id=None,
                 generator=torch.Generator().manual_seed(0), precision=precision_)
        return time.process_time() - t
    return run


def _without_amx(step: Callable[[], float]) -> Callable[[], float]:
    """The step with bf16 panels on the widened FMA kernel (csrc/amx_panels.h's tiles switched off), then on again."""
    def run() -> float:
        torch.ops.glm_lightning.panel_amx(False)
        try:
            return step()
        finally:
            torch.ops.glm_lightning.panel_amx(True)
    return run


def generation(model: GLMModel, samples: int = 16, new_tokens: int = 48, rounds: int = 3) -> dict[str, Any]:
    """Cached generation from the fp32 weights and from the bf16 copy, taking turns: tokens/s of each and the ratio;
    where the decode's bf16 panels run on AMX tiles, a third row without them (the widened FMA kernel)."""
    model.eval()
    steps = {name: _generation(model, p, samples, new_tokens) for name, p in (("fp32", "32"), ("bf16", "bf16"))}
    if cext.available() and torch.ops.glm_lightning.panel_amx():
        steps["bf16 no AMX"] = _without_amx(_generation(model, "bf16", samples, new_tokens))
    gen = _median_in_turns(steps, rounds)
    return {"generation": {name: {"s": s, "tokens_per_s": samples * new_tokens / s} for name, s in gen.items()},
            "generation_bf16_over_fp32": gen["fp32"] / gen["bf16"],
            **({"generation_bf16_no_amx_over_fp32": gen["fp32"] / gen["bf16 no AMX"]} if "bf16 no AMX" in gen else {})}


def run(quick: bool = False, batch: int = 32, seq: int = 128, native_batch: int = 2, samples: int = 16,
        new_tokens: int = 48) -> dict[str, Any]:
    torch.manual_seed(0)
    rounds = 1 if quick else 2
    if precision.native_bf16():  # issue 34's targets are for these CPUs: measure them at the full size
        native_batch = batch
    line = precision.describe()
    print(line)
    res: dict[str, Any] = {"native_bf16": precision.native_bf16(), "bf16_line": line, "batch": batch, "seq": seq,
                           "native_batch": native_batch, **utilization.machine_fields()}
    res["peak_gflops"] = {"fp32": gemm_peak_gflops("fp32", 1536, 6), "emulated": gemm_peak_gflops("emulated", 1536, 6),
                          "native": gemm_peak_gflops("native", 512 if not precision.native_bf16() else 1536, 3)}
    model = GLMModel(GLMConfig.preset("flash-25m"))
    active = model.num_parameters()["active"]
    same = native_batch == batch  # native bf16 here: the three modes take turns at the full size
    full = {mode: _in_mode(mode, make_step(model, hybrid_loss, batch, seq))
            for mode in (("fp32", "native", "emulated") if same else ("fp32", "emulated"))}
    secs = _median_in_turns(full, rounds)
    if same:
        secs_small = secs
    else:
        small = {mode: _in_mode(mode, make_step(model, hybrid_loss, native_batch, seq)) for mode in ("fp32", "native")}
        secs_small = _median_in_turns(small, rounds)
    peaks = res["peak_gflops"]
    train = {}
    for (mode, b), sec in [(("fp32", batch), secs["fp32"]), (("emulated", batch), secs["emulated"]),
                           (("fp32", native_batch), secs_small["fp32"]), (("native", native_batch),
                                                                          secs_small["native"])]:
        tokens = b * seq
        peak = peaks["fp32"] if mode == "fp32" else peaks[mode]
        train[f"{mode} {b}x{seq}"] = {"s_per_step": sec, "tokens_per_s": tokens / sec,
                                      "mfu": utilization.mfu(tokens / sec, utilization.train_flops_per_token(active),
                                                             peak)}
    res["train"] = train
    res["train_emulated_over_fp32"] = secs["fp32"] / secs["emulated"]
    res["train_native_over_fp32"] = secs_small["fp32"] / secs_small["native"]
    res.update(generation(model, samples, new_tokens, 1 if quick else 3))
    res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"GEMM peaks ({res['machine']}): fp32 {peaks['fp32']:.1f}, bf16 native {peaks['native']:.1f}, "
          f"bf16 emulated {peaks['emulated']:.1f} GFLOP/s")
    print(f"{'flash-25m training':<28}{'s/step':>9}{'tokens/s':>10}{'MFU':>8}  (MFU against its own peak)")
    for name, r in train.items():
        print(f"{name:<28}{r['s_per_step']:>9.2f}{r['tokens_per_s']:>10.0f}{r['mfu']:>8.1%}")
    print(f"bf16 / fp32 training throughput: emulated {res['train_emulated_over_fp32']:.2f}x ({batch}x{seq}), "
          f"native {res['train_native_over_fp32']:.2f}x ({native_batch}x{seq})")
    _print_generation(res, samples, new_tokens)
    return res


def _print_generation(res: dict[str, Any], samples: int, new_tokens: int) -> None:
    print(f"generation {samples} x {new_tokens} cached (CPU time): " + ", ".join(
        f"{m} {r['tokens_per_s']:.0f} tok/s" for m, r in res["generation"].items())
        + f"; bf16 / fp32 {res['generation_bf16_over_fp32']:.2f}x"
        + (f" (without AMX {res['generation_bf16_no_amx_over_fp32']:.2f}x)"
           if "generation_bf16_no_amx_over_fp32" in res else ""))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--generation", action="store_true", help="only the cached generation rows (fp32 and bf16)")
    p.add_argument("--rounds", type=int, default=5, help="turns of the generation rows with --generation")
    args = p.parse_args()
    if args.generation:
        from glm_lightning import machine

        print(f"{machine.describe()}")
        torch.manual_seed(0)
        _print_generation(generation(GLMModel(GLMConfig.preset("flash-25m")), rounds=args.rounds), 16, 48)
    else:
        run(args.quick)
