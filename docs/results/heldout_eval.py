"""Greedy pass of a pre-training checkpoint on the held-out families (`HELD_OUT_FAMILIES`: decrement, triple,
square_plus_one, max_of_list, never in any pre-training corpus), next to the families it was trained on: how far the
model generalises to near neighbours of what it learned. Prints the markdown table of docs/results/pretrain.md.

    PYTHONPATH=. python docs/results/heldout_eval.py CKPT [--per-family 8] [--seed 0]

The tasks are the dev split's (the split `val/dev_pass` uses, seed 0 as in the shipped configs), greedy completions
of at most 48 new tokens, scored in the sandboxed verifier; each count comes with its 95% Wilson interval.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from glm_lightning.generate_cli import load_model
from glm_lightning.stats import wilson_interval
from glm_lightning.sweep.starts import greedy_pass_by_family
from glm_lightning.tasks.families import CLASSIC_FAMILIES, HELD_OUT_FAMILIES


def table(counts: dict[str, tuple[int, int]], held_out: Sequence[str]) -> list[str]:
    lines = ["| family | in pre-training | greedy pass | 95% Wilson interval |", "|---|---|---:|---|"]
    for group in (list(held_out), [f for f in counts if f not in held_out]):
        k = sum(counts[f][0] for f in group)
        n = sum(counts[f][1] for f in group)
        for fam in group:
            fk, fn = counts[fam]
            lo, hi = wilson_interval(fk, fn)
            lines.append(f"| {fam} | {'no (held out)' if fam in held_out else 'yes'} | {fk}/{fn} | "
                         f"[{100 * lo:.0f}%, {100 * hi:.0f}%] |")
        lo, hi = wilson_interval(k, n)
        which = "held-out families" if group == list(held_out) else "trained families"
        lines.append(f"| **all {which}** | | **{k}/{n} ({100 * k / max(n, 1):.1f}%)** | "
                     f"[{100 * lo:.1f}%, {100 * hi:.1f}%] |")
    return lines


def main(argv: Sequence[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--per-family", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trained", nargs="*", default=list(CLASSIC_FAMILIES),
                   help="the families it was pre-trained on, for comparison (default: the 8 classic ones)")
    args = p.parse_args(argv)
    model = load_model(args.checkpoint)
    t0 = time.perf_counter()
    counts = greedy_pass_by_family(model, list(HELD_OUT_FAMILIES) + list(args.trained), args.per_family,
                                   seed=args.seed)
    lines = table(counts, HELD_OUT_FAMILIES)
    print("\n".join(lines))
    print(f"\n({time.perf_counter() - t0:.0f} s; {args.checkpoint})")
    return lines


if __name__ == "__main__":
    main()
