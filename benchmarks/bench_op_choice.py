"""The op-choice table on this CPU (issue 49, "never slower than PyTorch"): for every op with a C++ and a PyTorch form
and every size of the tuned thresholds, both forms timed in alternated rounds on the flash-25m preset's recorded calls
(glm_lightning/model/ops/tune.py), the form that the table in force runs (measured here by `python -m
glm_lightning.model.ops.tune`, or the shipped defaults), and whether that form was at least as fast as the other
within noise (the other did not win by choice.MARGIN in two thirds of the rounds).

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
    if table.digest() != choice.defaults().digest():
        res["end_to_end"] = end_to_end(table, rounds, quick)
    say(f"op table {table.digest()} ({table.source}), {torch.get_num_threads()} thread(s), {rounds} alternated "
        f"rounds, median ms per call")
    say(f"{'op / threshold at size':44s} {'form A':>22s} {'form B':>22s}  {'chosen':12s} {'speed-up':>8s}  "
        f"as fast within noise")
    for r in out:
        (fa, ta), (fb, tb) = r["forms"].items()
        say(f"{r['name']:44s} {fa:>12s} {ta:9.3f} {fb:>12s} {tb:9.3f}  {r['chosen']:12s} "
            f"{r['chosen_over_other']:7.2f}x  {'yes' if r['as_fast'] else 'NO'}")
    for name, r in res.get("end_to_end", {}).items():
        say(f"{name}: measured table {r['measured']['tokens_per_s']:.0f} tok/s, shipped defaults "
            f"{r['defaults']['tokens_per_s']:.0f} tok/s ({r['measured_over_defaults']:.2f}x)")
    return res


def end_to_end(table: choice.Table, rounds: int, quick: bool) -> dict:
    """The table in force against the shipped defaults on whole workloads, taking turns in one process: flash-25m
    cached generation (16 x 48 after a 64-token prompt; 16 x 16 when quick) and a training step (8 x 128, forward,
    backward). Seconds per run (this thread's CPU time at 1 thread: choice.clock), best of the round's 2 runs."""
    from glm_lightning.generation import generate
    from glm_lightning.model import GLMConfig, GLMModel

    torch.manual_seed(0)
    model = GLMModel(GLMConfig.preset("flash-25m"))
    ids, prompt, new = torch.randint(0, 256, (8, 129)), torch.randint(0, 256, (1, 64)), 16 if quick else 48

    def step() -> None:
        out = model(ids[:, :-1])
        (torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), ids[:, 1:].flatten()) + out.aux_loss).backward()

    def gen() -> None:
        with torch.no_grad():
            generate(model, prompt, max_new_tokens=new, num_samples=16, temperature=1.0, eos_id=None,
                     generator=torch.Generator().manual_seed(0))

    res, defaults = {}, choice.defaults()
    for name, work, n_tokens in ((f"generation 16 x {new}", gen, 16 * new), ("training step 8 x 128", step, 1024)):
        model.train(name.startswith("training"))
        m, d = choice.time_pair(lambda: _with(table, work), lambda: _with(defaults, work), rounds=max(2, rounds // 2),
                                min_block_s=0.0, blocks=2)
        res[name] = {"measured": {"s": statistics.median(m), "tokens_per_s": n_tokens / statistics.median(m)},
                     "defaults": {"s": statistics.median(d), "tokens_per_s": n_tokens / statistics.median(d)},
                     "measured_over_defaults": choice.speedup(m, d)}
    return res


def _with(table: choice.Table, work) -> None:
    with choice.using(table):
        work()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=choice.ROUNDS)
    args = p.parse_args()
    run(rounds=args.rounds)


if __name__ == "__main__":
    main()
