"""Measure this CPU's op table (choice.py) and cache it: which form of each op runs, and the shape thresholds.

    python -m glm_lightning.model.ops.tune [--threads 1,all] [--rounds 5] [--preset flash-25m] [--dry-run]

What is timed are the ops' real calls (recorded_calls.py): one training step (forward + backward, 2 x 128 tokens) and
one cached decode step (16 rows) of the preset are run once with every op's arguments recorded; then each op's calls are
replayed with its C++ form and with its PyTorch form, in alternated rounds (choice.time_pair), and the thresholds'
forms are timed at a few sizes on the preset's own weights, inside a cached decode where the few-row form is
panel_matmul on weights packed once (SMALL_ROWS: every decode linear at 1-64 rows; SMALL_TOKENS:
every MoE layer's experts at 1-96 tokens; DECODE_GATHER_MIN_KEYS_PER_TOP_K: one DSA layer's decode attention at 1-8 x
top_k keys; SEGMENT_TOKENS: one MoE layer's experts in training at 1,024-4,096 tokens, the busiest expert ~1.4x the
mean load). A choice departs from the shipped default only by choice.decide's margin rule. One progress line per op;
~25 s of CPU per thread count at one thread (2 min of wall time on the 2-core machine while other jobs loaded it 6-9;
at 2 threads there, every OpenMP op waited for a core: ~100x slower). `make venv` runs it (a failure there does not
fail the install).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from glm_lightning.model.ops import backend, choice, dsa, matmul, moe, thresholds
from glm_lightning.model.ops.recorded_calls import Call, record, replay

ROW_SIZES = (1, 4, 16, 32, 64)
TOKEN_SIZES = (1, 4, 16, 64, 96)
KEYS_PER_TOP_K = (1, 2, 4, 8)
SEGMENT_SIZES = (1024, 2048, 4096)


@contextmanager
def _threshold(name: str, value: float) -> Iterator[None]:
    before = getattr(thresholds, name)
    setattr(thresholds, name, value)
    try:
        yield
    finally:
        setattr(thresholds, name, before)


def _forced(fn: Callable[[], None], name: str, value: float) -> Callable[[], None]:
    def run() -> None:
        with _threshold(name, value):
            fn()
    return run


def _cpp_only(fn: Callable[[], None], op: str, on: bool) -> Callable[[], None]:
    def run() -> None:
        with backend.cpp_ops_off(() if on else (op,)):
            fn()
    return run


@dataclass
class Row:
    """One measured choice: the op (or a threshold at one size), both forms' seconds per round, the default form and
    whether the other replaced it (the margin rule)."""

    name: str
    key: str  # the op (choice.CPP_OPS) or threshold (choice.TUNED_THRESHOLDS)
    size: int | None  # the threshold's size measured (rows, tokens, keys per top_k); None for an op
    forms: tuple[str, str]  # (default form, other form)
    default_s: list[float]
    other_s: list[float]
    flipped: bool

    @property
    def chosen(self) -> str:
        return self.forms[1] if self.flipped else self.forms[0]

    @property
    def speedup(self) -> float:
        """How much faster the chosen form ran than the other (median over the rounds; < 1: slower, within the
        margin)."""
        return choice.speedup(self.other_s, self.default_s) if self.flipped else choice.speedup(self.default_s,
                                                                                                  self.other_s)

    def form_in(self, table: choice.Table) -> str:
        """The form that ``table`` runs for this row's op or size."""
        if self.size is None:
            return "C++" if table.cpp[self.key] else "PyTorch"
        limit = table.thresholds[self.key]
        if self.key == "DECODE_GATHER_MIN_KEYS_PER_TOP_K":
            return "mask" if self.size < limit else "gather"
        if self.key == "SEGMENT_TOKENS":
            return "padded" if self.size < limit else "segments"
        return "panel_matmul" if self.size <= limit else "BLAS"

    def seconds(self, form: str) -> list[float]:
        return self.default_s if form == self.forms[0] else self.other_s

    def as_fast(self, form: str) -> bool:
        """Whether ``form`` ran at least as fast as the other within noise: the other did not win by the margin in
        two thirds of the rounds (choice.decide)."""
        other = self.forms[1] if form == self.forms[0] else self.forms[0]
        return not choice.decide(self.seconds(form), self.seconds(other))


def _linear_probe(calls: list[Call], rows: int) -> Callable[[], None]:
    """Every distinct decode linear weight (the step streams them all: cold weights), at ``rows`` rows."""
    seen, items = set(), []
    for c in calls:
        weight = c.args[1]
        bias = c.args[2] if len(c.args) > 2 else c.kwargs.get("bias")
        if weight.dim() == 2 and weight.dtype is torch.float32 and weight.data_ptr() not in seen:
            seen.add(weight.data_ptr())
            items.append((torch.randn(rows, weight.shape[1]), weight.detach(), None if bias is None else bias.detach()))

    store: dict[torch.Tensor, torch.Tensor] = {}  # packed once, as one generation does (its first step)

    def run() -> None:
        with torch.no_grad(), matmul.packed_weights(store):  # inside a decode: the form that runs there
            for x, w, b in items:
                matmul.linear(x, w, b)

    return run


def _experts_probe(weights: list[tuple[torch.Tensor, torch.Tensor, int]], tokens: int) -> Callable[[], None]:
    """Each MoE layer's experts for ``tokens`` tokens routed at random (top-k distinct experts each)."""
    g = torch.Generator().manual_seed(tokens)
    items = []
    for wgu, wd, k in weights:
        E, d = wgu.shape[0], wgu.shape[-1]
        idx = torch.rand(tokens, E, generator=g).topk(k, dim=-1).indices
        items.append((torch.randn(tokens, d, generator=g), idx, torch.rand(tokens, k, generator=g).softmax(-1), wgu,
                      wd, torch.bincount(idx.reshape(-1), minlength=E)))

    store: dict[torch.Tensor, torch.Tensor] = {}

    def run() -> None:
        with torch.no_grad(), matmul.packed_weights(store):
            for x, idx, w, wgu, wd, counts in items:
                moe.moe_experts(x, idx, w, wgu, wd, counts)

    return run


def _segments_probe(call: Call, tokens: int) -> Callable[[], None]:
    """One MoE layer's experts in training (forward and backward) for ``tokens`` tokens whose routing loads the
    busiest expert ~SEGMENT_PADDING times the mean (where the two forms compete)."""
    wgu, wd, k = call.args[3].detach(), call.args[4].detach(), call.args[1].shape[-1]
    E, d = wgu.shape[0], wgu.shape[-1]
    g = torch.Generator().manual_seed(tokens)
    p = torch.ones(E)
    p[0] = thresholds.DEFAULTS["SEGMENT_PADDING"] * 1.1  # expert 0 busier than the rest
    idx = torch.multinomial(p.expand(tokens, E), k, replacement=False, generator=g)
    counts = torch.bincount(idx.reshape(-1), minlength=E)
    x = torch.randn(tokens, d, generator=g).requires_grad_()
    w = torch.rand(tokens, k, generator=g).softmax(-1).requires_grad_()
    wgu, wd = wgu.clone().requires_grad_(), wd.clone().requires_grad_()

    def run() -> None:
        y = moe.moe_experts(x, idx, w, wgu, wd, counts)
        torch.autograd.grad(y, (x, w, wgu, wd), torch.ones_like(y))

    return run


def _attention_probe(call: Call, keys: int) -> Callable[[], None]:
    """The recorded DSA decode attention (its q, cache buffers' shape and top_k) over ``keys`` cached keys."""
    q, k_buf, _, _, _, _, top_k = call.args
    B, Hkv, _, D = k_buf.shape
    g = torch.Generator().manual_seed(keys)
    k_buf, v_buf = torch.randn(B, Hkv, keys, D, generator=g), torch.randn(B, Hkv, keys, D, generator=g)
    s = torch.randn(B, 1, keys, generator=g)
    allowed = torch.ones(B, 1, keys, dtype=torch.bool)

    def run() -> None:
        with torch.no_grad():
            dsa.decode_attention(q, k_buf, v_buf, keys, s, allowed, top_k)

    return run


def measure(calls: dict[str, list[Call]], rounds: int = choice.ROUNDS, say: Callable[[str], None] = print,
            only: set[str] | None = None) -> tuple[choice.Table, list[Row]]:
    """Time every op's two forms and each threshold's forms on the recorded calls; the table they give (margin rule
    against the shipped defaults) and the rows measured."""
    ref = choice.defaults()
    cpp, limits, speedups, rows = dict(ref.cpp), dict(ref.thresholds), {}, []

    def compare(name: str, key: str, size: int | None, forms: tuple[str, str], default: Callable[[], None],
                other: Callable[[], None]) -> Row:
        d, o = choice.time_pair(default, other, rounds)
        row = Row(name, key, size, forms, d, o, choice.decide(d, o))
        rows.append(row)
        say(f"[ops] {name:40s} {forms[0]} {1e3 * statistics.median(d):8.3f} ms, {forms[1]} "
            f"{1e3 * statistics.median(o):8.3f} ms -> {row.chosen} ({row.speedup:.2f}x)")
        return row

    if backend.cpp_loaded():
        for op in choice.CPP_OPS:
            if only is not None and op not in only:
                continue
            if not calls.get(op):
                say(f"[ops] {op:32s} not called by the preset: C++ as shipped")
                continue
            run = replay(calls[op])
            row = compare(op, op, None, ("C++", "PyTorch"), _cpp_only(run, op, True), _cpp_only(run, op, False))
            cpp[op], speedups[op] = not row.flipped, row.speedup
        if calls.get("linear") and (only is None or "SMALL_ROWS" in only):
            small = {}
            for r in ROW_SIZES:
                probe = _linear_probe(calls["linear"], r)
                cpp_first = r <= ref.thresholds["SMALL_ROWS"]
                forms = ("panel_matmul", "BLAS") if cpp_first else ("BLAS", "panel_matmul")
                a, b = _forced(probe, "SMALL_ROWS", 10**9), _forced(probe, "SMALL_ROWS", 0)
                row = compare(f"SMALL_ROWS at {r} rows", "SMALL_ROWS", r, forms, *((a, b) if cpp_first else (b, a)))
                small[r] = row.chosen == "panel_matmul"
            limits["SMALL_ROWS"] = choice.threshold_from(ROW_SIZES, small, int(ref.thresholds["SMALL_ROWS"]), True)
            speedups["SMALL_ROWS"] = 1.0
        layers = _distinct_experts([c for c in calls.get("moe_experts", []) if not c.grad])
        if layers and (only is None or "SMALL_TOKENS" in only):
            small = {}
            for n in TOKEN_SIZES:
                probe = _experts_probe(layers, n)
                cpp_first = n <= ref.thresholds["SMALL_TOKENS"]
                forms = ("panel_matmul", "BLAS") if cpp_first else ("BLAS", "panel_matmul")
                a, b = _forced(probe, "SMALL_TOKENS", 10**9), _forced(probe, "SMALL_TOKENS", 0)
                row = compare(f"SMALL_TOKENS at {n} tokens", "SMALL_TOKENS", n, forms,
                              *((a, b) if cpp_first else (b, a)))
                small[n] = row.chosen == "panel_matmul"
            limits["SMALL_TOKENS"] = choice.threshold_from(TOKEN_SIZES, small, int(ref.thresholds["SMALL_TOKENS"]),
                                                           True)
            speedups["SMALL_TOKENS"] = 1.0
    attention = [c for c in calls.get("decode_attention", []) if not c.grad]
    if attention and (only is None or "DECODE_GATHER_MIN_KEYS_PER_TOP_K" in only):
        call, name = attention[-1], "DECODE_GATHER_MIN_KEYS_PER_TOP_K"
        top_k, sizes, mask_form = call.args[6], KEYS_PER_TOP_K, {}
        for m in sizes:
            probe = _attention_probe(call, m * top_k)
            mask_first = m < ref.thresholds[name]
            forms = ("mask", "gather") if mask_first else ("gather", "mask")
            a, b = _forced(probe, name, 10**9), _forced(probe, name, 0)
            row = compare(f"{name} at {m} x top_k", name, m, forms, *((a, b) if mask_first else (b, a)))
            mask_form[m] = row.chosen == "mask"
        limits[name] = choice.threshold_from(sizes, mask_form, int(ref.thresholds[name]), False)
        speedups[name] = 1.0
    training = [c for c in calls.get("moe_experts", []) if c.grad]
    if training and (only is None or "SEGMENT_TOKENS" in only):
        name, padded = "SEGMENT_TOKENS", {}
        for n in SEGMENT_SIZES:
            probe = _segments_probe(training[0], n)
            padded_first = n < ref.thresholds[name]
            forms = ("padded", "segments") if padded_first else ("segments", "padded")
            with _threshold("SEGMENT_PADDING", 0.0), _threshold("SEGMENT_PADDING_WORK", 0):  # the size alone decides
                a, b = _forced(probe, name, 10**9), _forced(probe, name, 0)
                row = compare(f"{name} at {n} tokens", name, n, forms, *((a, b) if padded_first else (b, a)))
            padded[n] = row.chosen == "padded"
        limits[name] = choice.threshold_from(SEGMENT_SIZES, padded, int(ref.thresholds[name]), False)
        speedups[name] = 1.0
    return choice.Table(cpp=cpp, thresholds=limits, source="measured", speedups=speedups), rows


def _distinct_experts(calls: list[Call]) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(w_gate_up, w_down, top_k) of each MoE layer seen in the recorded calls."""
    seen, out = set(), []
    for c in calls:
        wgu, wd, k = c.args[3].detach(), c.args[4].detach(), c.args[1].shape[-1]
        if wgu.data_ptr() not in seen and wgu.dtype is torch.float32:
            seen.add(wgu.data_ptr())
            out.append((wgu, wd, k))
    return out


def tune(threads: int, rounds: int = choice.ROUNDS, preset: str = "flash-25m", save: bool = True,
         say: Callable[[str], None] = print) -> tuple[choice.Table, list[Row]]:
    """Measure and (``save``) cache the table for ``threads`` threads; then put it in force."""
    torch.set_num_threads(threads)
    start = time.perf_counter()
    calls = record(preset)
    say(f"[ops] recorded the {preset} preset's op calls ({sum(len(c) for c in calls.values())} calls, "
        f"{time.perf_counter() - start:.1f} s); timing both forms, {rounds} alternated rounds each")
    with backend.cpp_ops_off(()):  # measure from a clean state, whatever table is in force
        table, rows = measure(calls, rounds, say)
    if save:
        path = choice.save(table, threads, {r.name: {"forms": r.forms, "default_s": r.default_s,
                                                     "other_s": r.other_s, "chosen": r.chosen} for r in rows})
        say(f"[ops] wrote {path} ({time.perf_counter() - start:.0f} s)")
    choice.forget()
    choice.apply(threads)
    return table, rows


def thread_counts(spec: str) -> list[int]:
    """'1,all' -> [1, cores]: the counts to measure (a run's default is every available core; tests run one)."""
    from glm_lightning.threads import available_cores

    counts = [available_cores() if part.strip() == "all" else int(part) for part in spec.split(",") if part.strip()]
    return sorted(set(counts))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Measure which form of each op runs on this CPU (the op table).")
    p.add_argument("--threads", default="1,all", help="thread counts to measure, e.g. '1', '1,2', '1,all' (default)")
    p.add_argument("--rounds", type=int, default=choice.ROUNDS)
    p.add_argument("--preset", default="flash-25m")
    p.add_argument("--dry-run", action="store_true", help="measure and print, do not write the table")
    args = p.parse_args(argv)
    for n in thread_counts(args.threads):
        tune(n, args.rounds, args.preset, save=not args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
