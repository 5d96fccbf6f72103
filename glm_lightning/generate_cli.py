"""`python -m glm_lightning generate --ckpt PATH [--prompt TEXT | --task FAMILY]`: try a trained model.

Tokens stream to the terminal as they are sampled. With `--task FAMILY` the prompt is a held-out task of that family
(`--split`, default `dev`), and every sample is run in the sandboxed verifier, whose verdict is printed under it.
Without `--prompt` or `--task`, a prompt of every family the checkpoint was trained or monitored on is sampled and
verified, ending with a per-family table (`--families all`: every registered family). Any stage's checkpoint works
(pre-training, vision, RL, or a `last.ckpt` of an unfinished run), and so does an export folder
(`python -m glm_lightning export`).

The model knows only the prompt format it was trained on: a `--prompt` that is a bare signature (`def double(x):`)
is wrapped in that header, and the run says so (`--raw` sends the prompt as written). Every sample ends with why it
stopped: the end token, the token limit, or the stop rule (a full `return` line).

    python -m glm_lightning generate --ckpt lightning_logs/demo/pretrain.ckpt --task increment --num_samples 4 \
        --temperature 0.7
    python -m glm_lightning generate --ckpt lightning_logs/demo/rl.ckpt --prompt 'def double(x):'
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from glm_lightning.precision import PRECISIONS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m glm_lightning generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint of any stage (e.g. lightning_logs/demo/pretrain.ckpt) "
                                                 "or an export folder")
    p.add_argument("--prompt", default=None, help="text to continue (a task prompt of --task is used otherwise)")
    p.add_argument("--raw", action="store_true", help="send --prompt as written (a bare signature is otherwise "
                                                      "wrapped in the training header)")
    p.add_argument("--task", default=None, metavar="FAMILY", help="build the prompt from a task of this family and "
                                                                  "verify every sample")
    p.add_argument("--families", default=None, help="without --prompt/--task: comma-separated families, or 'all' "
                                                    "(default: the families the checkpoint was trained or monitored on)")
    p.add_argument("--num_samples", type=int, default=1, help="samples per prompt (default 1)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); e.g. 0.7 to sample")
    p.add_argument("--max_new_tokens", type=int, default=64, help="longest completion (default 64)")
    p.add_argument("--per_family", type=int, default=1, help="prompts per family when no prompt is given (default 1)")
    p.add_argument("--split", default="dev", help="task split of --task prompts: train, dev, rl, confirm (default dev)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed and task identity seed (default 0)")
    p.add_argument("--precision", default="32", choices=PRECISIONS,
                   help="sample from the fp32 weights (32, default) or a bf16 copy of them (bf16; README, Precision)")
    return p


def trained_families(record: dict[str, Any]) -> tuple[list[str], str]:
    """The families a checkpoint's run trained or monitored (from its recorded data settings), and where they came
    from; the 8 classic families when the checkpoint names none."""
    from glm_lightning.tasks.families import CLASSIC_FAMILIES, resolve_families

    data = record.get("data") or {}
    if data.get("train_families"):
        train = list(resolve_families(data["train_families"]))
        monitor = data.get("monitor_families")
        monitor = [f for f in CLASSIC_FAMILIES if f not in train] if monitor is None else \
            list(resolve_families(monitor)) if monitor else []
        return [*train, *(f for f in monitor if f not in train)], "the RL run's rewarded and monitored families"
    if data.get("corpus", "functions") == "functions" and data.get("families"):
        return list(resolve_families(data["families"])), "the pre-training corpus's families"
    return list(CLASSIC_FAMILIES), "the 8 classic families (the checkpoint names none)"


def task_prompts(args: argparse.Namespace, record: dict[str, Any] | None = None) -> tuple[list[Any], str]:
    """The tasks to sample (and verify), and a line saying which families they cover and why."""
    from glm_lightning.tasks.families import family_names, get_family, resolve_families
    from glm_lightning.tasks.task import make_tasks

    if args.task is not None:
        get_family(args.task)  # a clear error for an unknown family
        return make_tasks(args.split, max(1, args.per_family), [args.task], seed=args.seed), args.task
    if args.families == "all":
        families, why = list(family_names()), "every registered family (--families all)"
    elif args.families:
        families, why = list(resolve_families(args.families)), "--families"
    else:
        families, why = trained_families(record or {})
    return make_tasks(args.split, args.per_family, families, seed=args.seed), f"{len(families)} families: {why}"


def check_args(args: argparse.Namespace) -> None:
    if args.num_samples < 1:
        raise ValueError(f"--num_samples must be >= 1, got {args.num_samples}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if args.per_family < 1:
        raise ValueError(f"--per_family must be >= 1, got {args.per_family}")
    if args.prompt is not None and args.task is not None:
        raise ValueError("give either --prompt or --task, not both")
    if args.families is not None and (args.prompt is not None or args.task is not None):
        raise ValueError("--families picks the prompts when neither --prompt nor --task is given")
    if args.prompt is not None and not args.prompt.strip():
        raise ValueError("the prompt is empty: give some text to continue (--prompt) or a task (--task FAMILY)")


def family_table(results: list[tuple[str, list[str], list[Any]]], tasks: list[Any]) -> str:
    """Passed / sampled per family, in the order sampled, with the total."""
    rows: dict[str, list[int]] = {}
    for task, (_, _, verdicts) in zip(tasks, results):
        row = rows.setdefault(task.family, [0, 0])
        row[0] += sum(v.status == "passed" for v in verdicts)
        row[1] += len(verdicts)
    width = max([len("family"), *map(len, rows)])
    lines = [f"{'family':<{width}}  passed", *(f"{f:<{width}}  {p}/{n}" for f, (p, n) in rows.items())]
    total = [sum(r[0] for r in rows.values()), sum(r[1] for r in rows.values())]
    lines.append(f"{'total':<{width}}  {total[0]}/{total[1]} ({total[0] / max(1, total[1]):.0%})")
    return "\n".join(lines)


def run(argv: Sequence[str], out: Callable[[str], None] | None = None) -> list[tuple[str, list[str], list[Any]]]:
    """Everything `main` does; returns (prompt, samples, verdicts) per prompt (verdicts empty for free prompts)."""
    args = build_parser().parse_args(list(argv))
    check_args(args)
    write = out or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    note = lambda s: (sys.stderr.write(f"[generate] {s}\n"), sys.stderr.flush())  # noqa: E731
    note(f"loading {args.ckpt}")
    import torch

    from glm_lightning.generation import sampling_weights
    from glm_lightning.pretrained import Sample, as_training_prompt, load, stream_sample

    pretrained = load(args.ckpt)
    tasks, which = ([], "") if args.prompt is not None else task_prompts(args, pretrained.info)
    if args.precision != "32":
        from glm_lightning.precision import describe as describe_bf16

        note(describe_bf16())  # bf16 is native here or emulated (README, "Precision")
    model = sampling_weights(pretrained.model, args.precision)
    generator = torch.Generator().manual_seed(args.seed)
    if tasks:
        note(f"sampling {len(tasks)} prompt(s) x {args.num_samples} from {which}; each sample verified")
    from glm_lightning.evaluation import VerifierSettings, completion_finished, verifier_jobs

    verifier = VerifierSettings(workers=1).build() if tasks else None
    if verifier is not None:  # what isolates the samples here, or which promised protection is missing
        sys.stderr.write(verifier.summary() + "\n")
    prompt_seen = args.prompt
    if args.prompt is not None and not args.raw:
        prompt_seen, wrapped = as_training_prompt(args.prompt)
        if wrapped:
            note("the prompt is a bare signature: wrapped in the training header the model knows (--raw sends it "
                 "as written)")
    results = []
    try:
        for task in tasks or [None]:
            prompt = prompt_seen if task is None else task.prompt
            head = "prompt" if task is None else f"[{task.family}] {task.entry_point}"
            samples = []
            for k in range(args.num_samples):
                count = f", sample {k + 1}/{args.num_samples}" if args.num_samples > 1 else ""
                write(f"=== {head}{count} ===\n{prompt}")
                sample: Sample = stream_sample(model, prompt, args.max_new_tokens, args.temperature, generator,
                                               write, stop=completion_finished if task is not None or
                                               prompt != args.prompt else None)
                samples.append(sample.text)
                write(f"\n[stopped: {sample.stop}]\n")
            verdicts = verifier.check_many(verifier_jobs([task] * len(samples), samples)) if task is not None else []
            for k, v in enumerate(verdicts):
                write(f"verdict {k + 1}/{len(verdicts)}: {v.status} ({v.passed_cases}/{v.total_cases} tests)\n")
            results.append((prompt, samples, verdicts))
    finally:
        if verifier is not None:
            verifier.close()
    if len(tasks) > 1:
        write("\n" + family_table(results, tasks) + "\n")
    return results


def main(argv: Sequence[str] | None = None) -> None:
    run(sys.argv[1:] if argv is None else argv)
