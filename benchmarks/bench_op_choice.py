"""The op-choice table on this CPU (issue 49, "never slower than PyTorch"): for every op with a C++ and a PyTorch form
and every size of the tuned thresholds, both forms timed in alternated rounds on the flash-25m preset's recorded calls
(glm_lightning/model/ops/tune.py), the form that the table in force runs (measured here by `python -m
glm_lightning.model.ops.tune`, or the shipped defaults), and whether that form was at least as fast as the other
within noise (the other did not win by choice.MARGIN in most rounds).

    python -m benchmarks --only op_choice      (or: python -m benchmarks.bench_op_choice [--rounds 5])
"""

from __future__ import annotations

import argparse
import statistics

import torch

from glm_lightning.model.ops import backend, choice, tune


def run(quick: bool = False, rounds: int | None = None, say=print) -> dict:
    rounds = rounds or (3 if quick else choice.ROUNDS)
    table = choice.active()
    calls = tune.record()
    with backend.cpp_ops_off(()):
        _, rows = tune.measure(calls, rounds, say=lambda line: None)
    out = []
    for r in rows:
        form = r.form_in(table)
        other = r.forms[1] if form == r.forms[0] else r.forms[0]
        out.append({"name": r.name, "forms": {f: 1e3 * statistics.median(r.seconds(f)) for f in r.forms},
                    "chosen": form, "other": other, "chosen_over_other": statistics.median(
                        o / c for c, o in zip(r.seconds(form), r.seconds(other))), "as_fast": r.as_fast(form)})
    res = {"table": {**table.record(), "threads": torch.get_num_threads()}, "rounds": rounds, "rows": out,
           "slower": [r["name"] for r in out if not r["as_fast"]]}
    say(f"op table {table.digest()} ({table.source}), {torch.get_num_threads()} thread(s), {rounds} alternated "
        f"rounds, median ms per call")
    say(f"{'op / threshold at size':44s} {'form A':>22s} {'form B':>22s}  {'chosen':12s} {'speed-up':>8s}  "
        f"as fast within noise")
    for r in out:
        (fa, ta), (fb, tb) = r["forms"].items()
        say(f"{r['name']:44s} {fa:>12s} {ta:9.3f} {fb:>12s} {tb:9.3f}  {r['chosen']:12s} "
            f"{r['chosen_over_other']:7.2f}x  {'yes' if r['as_fast'] else 'NO'}")
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=choice.ROUNDS)
    args = p.parse_args()
    run(rounds=args.rounds)


if __name__ == "__main__":
    main()
