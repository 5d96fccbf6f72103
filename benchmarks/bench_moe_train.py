"""One flash-25m MoE layer's routed experts in training (forward + backward) at 32 x 128 tokens, the forms of
glm_lightning/model/ops/moe.py alternated in one process, each call timed in CPU time (1 thread by default):

- ``padded``: the zero-padded [E, max load, d] batch (_GroupedExperts: two bmm forward, four backward);
- ``segment``: each expert on its own rows (_SegmentExperts: per-expert mm, no padding rows computed);
- ``shipped``: whichever of the two the thresholds choose (thresholds.py, or this CPU's op table).

Routings with the busiest expert at a few loads over the mean (a fresh flash-25m layer: 1.07-1.18x), and the ops'
CPU time and minor page faults (``resource.getrusage``) per call. Outputs and gradients are compared between forms.

    python -m benchmarks.bench_moe_train [--rounds 9] [--threads 1] [--skew 1.0 1.1 1.25] [--bf16] [--step] [--study-step]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from glm_lightning.model import GLMConfig
from glm_lightning.model.ops import moe, thresholds

FORMS: dict[str, dict[str, float] | None] = {
    "padded": {"SEGMENT_TOKENS": 1, "SEGMENT_PADDING": 1e30, "SEGMENT_PADDING_WORK": 0},
    "segment": {"SEGMENT_TOKENS": 1, "SEGMENT_PADDING": 0, "SEGMENT_PADDING_WORK": 0},
    "shipped": None}
"""Each form as the thresholds that select it (``shipped``: thresholds.py's values or this CPU's op table)."""


@contextmanager
def form(name: str) -> Iterator[None]:
    """Run moe_experts in the named form (thresholds restored after)."""
    values = FORMS[name] or {}
    old = {k: getattr(thresholds, k) for k in values}
    for k, v in values.items():
        setattr(thresholds, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(thresholds, k, v)


def routing(tokens: int, E: int, K: int, skew: float, seed: int) -> torch.Tensor:
    """Choices idx [tokens, K] (distinct experts per token), expert 0 weighted ``skew`` (busier than the rest)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.ones(E)
    p[0] = skew  # sampled without replacement: the realised skew is printed
    return torch.multinomial(p.expand(tokens, E), K, replacement=False, generator=g)


def layer_call(cfg: GLMConfig, tokens: int, skew: float, seed: int = 0,
               bf16: bool = False) -> tuple[Callable[[], list[torch.Tensor]], float]:
    """fwd + bwd of one layer's routed experts (under bf16 autocast: bf16-mixed training's GEMMs); returns the call
    (giving y and the gradients) and the real skew."""
    g = torch.Generator().manual_seed(seed)
    E, K, d, h = cfg.n_experts, cfg.moe_top_k, cfg.d_model, cfg.expert_hidden
    idx = routing(tokens, E, K, skew, seed)
    counts = torch.bincount(idx.reshape(-1), minlength=E)
    x = torch.randn(tokens, d, generator=g).requires_grad_()
    w = torch.rand(tokens, K, generator=g).requires_grad_()
    wgu = (0.05 * torch.randn(E, 2 * h, d, generator=g)).requires_grad_()
    wd = (0.05 * torch.randn(E, d, h, generator=g)).requires_grad_()
    dy = torch.randn(tokens, d, generator=g)

    def run() -> list[torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = moe.moe_experts(x, idx, w, wgu, wd, counts)
        return [y.detach().float(), *torch.autograd.grad(y, (x, w, wgu, wd), dy.to(y.dtype))]

    return run, float(counts.max()) * E / (tokens * K)


def in_turns(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, tuple[float, float]]:
    """Median CPU seconds and minor faults per call of each form, the forms alternated round by round, each turn an
    untimed call then a timed one: switching forms changes the allocation pattern, and glibc's first call after a
    switch returns and maps memory again (tens of thousands of page faults), which a run of one form never sees."""
    times: dict[str, list[float]] = {k: [] for k in calls}
    faults: dict[str, list[int]] = {k: [] for k in calls}
    for _ in range(rounds):
        for k, f in calls.items():
            f()
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
            f()
            times[k].append(time.process_time() - t0)
            faults[k].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
    return {k: (statistics.median(times[k]), statistics.median(faults[k])) for k in calls}


def compare(cfg: GLMConfig, tokens: int, skew: float, rounds: int, bf16: bool = False) -> None:
    """One table row per form at one routing skew; outputs checked against the padded form."""
    run, real = layer_call(cfg, tokens, skew, bf16=bf16)
    outs, calls = {}, {}
    for name in FORMS:
        def call(name: str = name) -> list[torch.Tensor]:
            with form(name):
                return run()
        calls[name] = call
        outs[name] = call()
    diff = max(float((a - b).abs().max()) for a, b in zip(outs["padded"], outs["segment"]))
    del calls["shipped"]  # one of the two
    res = in_turns(calls, rounds)
    base = res["padded"][0]
    for name, (t, flt) in res.items():
        print(f"{real:5.2f}x  {name:8s} {t * 1e3:8.2f} ms  {base / t:5.2f}x  {flt:7.0f} faults  max|diff| {diff:.1e}")


def steps(rounds: int, name: str = "flash-25m") -> None:
    """Whole training steps (fwd + bwd + AdamW) of profile_step's model ``name`` (flash-25m at 32 x 128, the study model
    at 8 x 128) with each form, alternated step by step."""
    from benchmarks.profile_step import build, make_optimizer, train_step
    model, B, T = build(name)
    opt = make_optimizer(model)
    ids = torch.randint(0, model.cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(0))
    calls = {}
    for form_name in FORMS:
        def call(form_name: str = form_name) -> None:
            with form(form_name):
                train_step(model, opt, ids)
        calls[form_name] = call
    for f in calls.values():  # warm-up: the allocator settles after two steps
        f()
    res = in_turns(calls, rounds)
    base = res["padded"][0]
    print(f"{name} training steps, {B} x {T}")
    for form_name, (t, flt) in res.items():
        print(f"step     {form_name:8s} {t * 1e3:8.1f} ms  {base / t:5.2f}x  {flt:7.0f} faults")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=32 * 128)
    ap.add_argument("--skew", type=float, nargs="+", default=[1.0, 1.1, 1.25])
    ap.add_argument("--bf16", action="store_true", help="the experts under bf16 autocast (bf16-mixed training)")
    ap.add_argument("--step", action="store_true", help="also whole training steps, the forms in turns")
    ap.add_argument("--study-step", action="store_true", help="also the study model's steps (dispatch-bound)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = GLMConfig.preset("flash-25m")
    print(f"flash-25m routed experts fwd+bwd{' (bf16 autocast)' if args.bf16 else ''}, {args.tokens} tokens, {torch.get_num_threads()} thread(s), CPU time, "
          f"medians of {args.rounds} in turns")
    print("busiest  form          time  vs padded   faults")
    for skew in args.skew:
        compare(cfg, args.tokens, skew, args.rounds, args.bf16)
    if args.step:
        steps(args.rounds)
    if args.study_step:
        steps(args.rounds, "study")


if __name__ == "__main__":
    main()
