"""The mHC training ops of this tree vs a base revision's, alternated in one process (1 thread, CPU time): each op at
flash-25m's shape (streams [32 * 128, 4, 192] fp32), then whole flash-25m training steps (32 x 128) with the base's
site read / stream write kernels and data flow patched in, taking turns with this tree's.

    python -m benchmarks.bench_mhc_ops [--base db119f5] [--rounds 12] [--steps 3]
    python -m benchmarks.bench_mhc_ops --linked [--rounds 12] [--steps 3]   # linked site writes against unlinked

The base's csrc/site_read.cpp, streams.cpp and sinkhorn.cpp are compiled once (cached beside the C++ library, ~2 min)
under the op namespace ``glm_base``, so both forms load side by side. The op inputs cycle over 6 copies (~270 MB), so
that the streams come from memory as in a training step, not from the cache a previous call left them in; glibc keeps
freed memory (mallopt), as a training process reaches that state: otherwise each call's fresh 12.6 MB output is
page-faulted in (a clone of the streams then took 6.0 ms instead of 1.6).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import torch

from glm_lightning.model import cext

ROOT = Path(__file__).resolve().parent.parent
CSRC = "glm_lightning/model/csrc"
FILES = ("site_read.cpp", "streams.cpp", "sinkhorn.cpp", "sinkhorn.h", "kernel_helpers.h", "lanes.h")
BASE_REV = "db119f5"
"""main before the kernels of issue 49 part 3 (this benchmark's first run)."""
PATCHED = ("site_read", "site_read_backward", "stream_write", "stream_write_backward")
"""The ops whose base kernels a base training step runs (the others are this tree's)."""


def keep_freed_memory() -> None:
    """glibc: no mmap for large blocks, no trimming, so a freed buffer is reused without page faults."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, ctypes.c_int(2**31 - 1))  # M_MMAP_THRESHOLD
    libc.mallopt(-1, ctypes.c_int(2**31 - 1))  # M_TRIM_THRESHOLD


def load_base(rev: str) -> None:
    """Build (once) and load the base revision's mHC ops as torch.ops.glm_base."""
    sources = {f: subprocess.run(["git", "show", f"{rev}:{CSRC}/{f}"], cwd=ROOT, capture_output=True, check=True)
               .stdout for f in FILES}
    key = hashlib.sha256(b"".join(sources.values()) + " ".join(cext._compile_flags()).encode()).hexdigest()[:16]
    out = cext.library_path().parent / f"glm_base_mhc_{key}.so"
    if not out.exists():
        with tempfile.TemporaryDirectory() as tmp:
            for f, text in sources.items():
                (Path(tmp) / f).write_bytes(text)
            unit = Path(tmp) / "unit.cpp"
            unit.write_text("".join(f'#include "{f}"\n' for f in FILES if f.endswith(".cpp")))
            names = ["-Dglm_lightning=glm_base", "-Dglm_lightning_ops=glm_base_ops"]
            subprocess.run(["g++", str(unit), *cext._compile_flags(), *names, *cext._link_flags(), "-o", str(out)],
                           check=True)
    torch.ops.load_library(str(out))


def op_inputs(gen: torch.Generator, N: int = 4096, n: int = 4, C: int = 192, ns: object = None
              ) -> dict[str, torch.Tensor]:
    """The site read's and stream write's arguments and output gradients at one site of flash-25m."""
    L = n * n + 2 * n
    x, phi = torch.randn(N, n, C, generator=gen), torch.randn(L, n * C, generator=gen) * 0.02
    d = dict(x=x, phi=phi, alpha_e=torch.full((L,), 0.01), bias=torch.randn(L, generator=gen),
             scale=torch.tensor([1.0] * n + [2.0] * n), shift=torch.tensor([1e-6] * n + [0.0] * n))
    h, gates, _, d["inv"], d["raw"], d["sig"] = (ns or torch.ops.glm_base).site_read(
        x, phi, d["alpha_e"], d["bias"], d["scale"], d["shift"], 1e-5)
    d.update(gates=gates, post=gates[:, n:], res=torch.softmax(torch.randn(N, n, n, generator=gen), -1),
             y=torch.randn(N, C, generator=gen), g=torch.randn(N, n, C, generator=gen),
             dh=torch.randn(N, C, generator=gen), dpost=torch.randn(N, n, generator=gen),
             dres=torch.randn(N, n, n, generator=gen), soft=torch.softmax(torch.randn(N, n, n, generator=gen), -1))
    return d


def op_calls(ns: object, d: dict[str, torch.Tensor]) -> dict[str, Callable[[], object]]:
    """The compared calls; the linked ones and Sinkhorn's only where both forms have them (a base may predate them)."""
    calls = {
        "site_read": lambda: ns.site_read(d["x"], d["phi"], d["alpha_e"], d["bias"], d["scale"], d["shift"], 1e-5),
        "site_read_backward": lambda: ns.site_read_backward(d["dh"], d["dpost"], d["dres"], d["x"], d["phi"],
                                                            d["alpha_e"], d["scale"], d["inv"], d["raw"], d["sig"],
                                                            d["gates"]),
        "stream_write": lambda: ns.stream_write(d["res"], d["x"], d["post"], d["y"]),
        "stream_write_backward": lambda: ns.stream_write_backward(d["g"], d["res"], d["x"], d["post"], d["y"]),
    }
    if all(hasattr(form, "site_read_backward_linked") for form in (torch.ops.glm_base, torch.ops.glm_lightning)):
        calls.update({
            "site_read_backward_linked": lambda: ns.site_read_backward_linked(
                d["dh"], d["dpost"], None, d["g"], d["res"], d["soft"], 20, 1e-6, d["x"], d["phi"], d["alpha_e"],
                d["scale"], d["inv"], d["raw"], d["sig"], d["gates"]),
            "stream_write_backward_linked": lambda: ns.stream_write_backward_linked(d["g"], d["post"], d["y"]),
            "sinkhorn": lambda: ns.sinkhorn(d["dres"], 20, 1e-6),
            "sinkhorn_backward": lambda: ns.sinkhorn_backward(d["dres"], d["soft"], 20, 1e-6),
        })
    return calls


def compare_ops(rounds: int) -> None:
    sets = [op_inputs(torch.Generator().manual_seed(i)) for i in range(6)]
    forms = {"base": torch.ops.glm_base, "this tree": torch.ops.glm_lightning}
    ms: dict[tuple[str, str], list[float]] = {}
    for r in range(rounds):
        for op in op_calls(torch.ops.glm_base, sets[0]):
            for form, ns in forms.items():
                call = op_calls(ns, sets[r % len(sets)])[op]
                t = time.process_time()
                call()
                ms.setdefault((form, op), []).append((time.process_time() - t) * 1e3)
    print(f"{'op, ms per call (median)':<30}{'base':>8}{'this tree':>11}{'speedup':>9}{'same values':>13}")
    for op in op_calls(torch.ops.glm_base, sets[0]):
        outs = [op_calls(ns, sets[0])[op]() for ns in forms.values()]
        outs = [o if isinstance(o, tuple | list) else (o,) for o in outs]
        same = all(torch.equal(a, b) for a, b in zip(*outs))
        b, t = (statistics.median(ms[(f, op)]) for f in forms)
        print(f"{op:<30}{b:>8.2f}{t:>11.2f}{b / t:>8.2f}x{'bit for bit' if same else 'no':>13}")


LINKED = ("site_read_backward_linked", "stream_write_backward_linked", "sinkhorn", "sinkhorn_backward")
"""The further ops a base with linked writes runs as its own (then its steps keep the linked data flow)."""


def base_step_patches(stack: ExitStack) -> None:
    """A training step as the base ran it: its kernels, and (a base without linked writes) the write taking x itself
    (autograd adds the two gradients of the streams)."""
    from glm_lightning.model.mhc import HyperConnection

    from glm_lightning.model.ops import mhc as mhc_ops

    if hasattr(torch.ops.glm_base, LINKED[0]):
        for name in PATCHED + LINKED:
            stack.enter_context(mock.patch.object(torch.ops.glm_lightning, name, getattr(torch.ops.glm_base, name)))
        return
    stack.enter_context(mock.patch.object(mhc_ops, "LINK_WRITES", False))  # the base had no linked write
    for name in PATCHED:
        op = getattr(torch.ops.glm_base, name)
        if name == "site_read_backward":  # the base op has no dx_acc (None here: the write takes x itself)
            op = (lambda base: lambda *a: base(*a[:11]))(op)
        stack.enter_context(mock.patch.object(torch.ops.glm_lightning, name, op))
    read = HyperConnection.read
    stack.enter_context(mock.patch.object(HyperConnection, "read", lambda self, x: (
        lambda h, maps: (h, None if maps is None else maps[:2]))(*read(self, x))))


def steps_in_turns(rounds: int, steps: int, forms: dict[str, Callable[[ExitStack], None]]) -> dict[str, list[float]]:
    """CPU seconds of flash-25m training steps (32 x 128) under each form (a function entering its patches on the
    stack), the forms taking turns: per round and form one untimed step after the switch, then ``steps`` timed."""
    from benchmarks.profile_step import build, make_optimizer, train_step

    model, batch, seq = build("flash-25m")
    opt = make_optimizer(model)
    ids = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {form: [] for form in forms}
    for _ in range(rounds):
        for form, patch in forms.items():
            with ExitStack() as stack:
                patch(stack)
                train_step(model, opt, ids)  # untimed after a switch
                for _ in range(steps):
                    t = time.process_time()
                    train_step(model, opt, ids)
                    times[form].append(time.process_time() - t)
    return times


def compare_steps(rounds: int, steps: int) -> None:
    times = steps_in_turns(rounds, steps, {"base": base_step_patches, "this tree": lambda stack: None})
    b, t = (statistics.median(v) for v in times.values())
    print(f"flash-25m training step 32 x 128, CPU s (median of {rounds} x {steps}): base {b:.3f}, this tree {t:.3f}, "
          f"{b / t:.3f}x")


def compare_linked_ops(rounds: int) -> None:
    """A site's backward as the unlinked ops (Sinkhorn backward, the write's full backward, the read's with dx_acc)
    against the linked ones (the write's d H_post / d y only, the read's forming the rest), alternated."""
    ns = torch.ops.glm_lightning
    sets = [op_inputs(torch.Generator().manual_seed(i), ns=ns) for i in range(6)]

    def unlinked(d: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        dres, gx, dpost, dy = ns.stream_write_backward(d["g"], d["res"], d["x"], d["post"], d["y"])
        dlog = ns.sinkhorn_backward(dres, d["soft"], 20, 1e-6)
        return (*ns.site_read_backward(d["dh"], dpost, dlog, d["x"], d["phi"], d["alpha_e"], d["scale"], d["inv"],
                                       d["raw"], d["sig"], d["gates"], gx), dy)

    def linked(d: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        dpost, dy = ns.stream_write_backward_linked(d["g"], d["post"], d["y"])
        return (*ns.site_read_backward_linked(d["dh"], dpost, None, d["g"], d["res"], d["soft"], 20, 1e-6, d["x"],
                                              d["phi"], d["alpha_e"], d["scale"], d["inv"], d["raw"], d["sig"],
                                              d["gates"]), dy)

    forms = {"unlinked": unlinked, "linked": linked}
    ms: dict[str, list[float]] = {f: [] for f in forms}
    for r in range(rounds):
        for form, fn in forms.items():
            t = time.process_time()
            fn(sets[r % len(sets)])
            ms[form].append((time.process_time() - t) * 1e3)
    same = all(torch.equal(a, b) for a, b in zip(unlinked(sets[0]), linked(sets[0])))
    u, k = (statistics.median(v) for v in ms.values())
    print(f"a site's backward (write + Sinkhorn + read), ms per site (median of {rounds}): unlinked {u:.2f}, linked "
          f"{k:.2f}, {u / k:.2f}x, {'bit for bit' if same else 'values differ'}")


def compare_linked_steps(rounds: int, steps: int) -> None:
    """Whole flash-25m training steps with the sites' writes linked and not, taking turns."""
    from glm_lightning.model.ops import mhc as mhc_ops

    def linking(on: bool) -> Callable[[ExitStack], None]:
        return lambda stack: stack.enter_context(mock.patch.object(mhc_ops, "LINK_WRITES", on))

    named = steps_in_turns(rounds, steps, {"unlinked": linking(False), "linked": linking(True)})
    times = {False: named["unlinked"], True: named["linked"]}
    u, k = (statistics.median(v) for v in times.values())
    print(f"flash-25m training step 32 x 128, CPU s (median of {rounds} x {steps}): unlinked {u:.3f}, linked {k:.3f}, "
          f"{u / k:.3f}x; per round: " + " ".join(f"{a / b:.3f}" for a, b in zip(times[False], times[True])))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--base", default=BASE_REV, help="git revision of the base kernels")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=3, help="timed training steps per turn (0: ops only)")
    p.add_argument("--linked", action="store_true", help="this tree's linked site writes against unlinked instead")
    args = p.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()
    if not cext.available():
        raise SystemExit("the C++ ops are not available (GLM_LIGHTNING_EXT=0 or no compiler)")
    if args.linked:
        print(f"{cext._cpu_model().split(':')[-1].strip()}, {torch.get_num_threads()} thread")
        compare_linked_ops(args.rounds)
        if args.steps:
            compare_linked_steps(max(2, args.rounds // 4), args.steps)
        return
    load_base(args.base)
    print(f"{cext._cpu_model().split(':')[-1].strip()}, {torch.get_num_threads()} thread, base {args.base}")
    compare_ops(args.rounds)
    if args.steps:
        compare_steps(max(2, args.rounds // 4), args.steps)


if __name__ == "__main__":
    main()
