"""`python -m glm_lightning generate --ckpt PATH [--prompt TEXT | --task FAMILY]`: try a trained model.

Tokens stream to the terminal as they are sampled. With `--task FAMILY` the prompt is a held-out task of that family
(`--split`, default `dev`), and every sample is run in the sandboxed verifier, whose verdict is printed under it.
Without `--prompt` or `--task`, a few prompts of every family are sampled and verified. Any stage's checkpoint works
(pre-training, vision, RL, or a `last.ckpt` of an unfinished run).

    python -m glm_lightning generate --ckpt lightning_logs/demo/pretrain.ckpt --task increment --num_samples 4 \
        --temperature 0.7
    python -m glm_lightning generate --ckpt lightning_logs/demo/rl.ckpt --prompt 'def double(x):'
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from glm_lightning.evaluation import VerifierSettings, completion_finished, verifier_jobs
from glm_lightning.generation import PRECISIONS, sample_next, sampling_weights
from glm_lightning.model import GLMModel
from glm_lightning.modules.base import read_checkpoint
from glm_lightning.precision import describe as describe_bf16
from glm_lightning.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
BANNED = (TOK.pad_id, TOK.bos_id, TOK.image_start_id, TOK.image_id, TOK.image_end_id)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m glm_lightning generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint of any stage (e.g. lightning_logs/demo/pretrain.ckpt)")
    p.add_argument("--prompt", default=None, help="text to continue (a task prompt of --task is used otherwise)")
    p.add_argument("--task", default=None, metavar="FAMILY", help="build the prompt from a task of this family and "
                                                                  "verify every sample")
    p.add_argument("--num_samples", type=int, default=1, help="samples per prompt (default 1)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); e.g. 0.7 to sample")
    p.add_argument("--max_new_tokens", type=int, default=64, help="longest completion (default 64)")
    p.add_argument("--per_family", type=int, default=1, help="prompts per family when no prompt is given (default 1)")
    p.add_argument("--split", default="dev", help="task split of --task prompts: train, dev, rl, confirm (default dev)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed and task identity seed (default 0)")
    p.add_argument("--precision", default="32", choices=PRECISIONS,
                   help="sample from the fp32 weights (32, default) or a bf16 copy of them (bf16; README, Precision)")
    return p


def load_model(path: str) -> GLMModel:
    """The shared model of any stage's checkpoint, in eval mode."""
    cfg, state, _ = read_checkpoint(path)
    model = GLMModel(cfg)
    if "lm_head.weight" in state:
        model.untie_head()
    model.load_state_dict(state)
    return model.eval()


@torch.inference_mode()
def stream_sample(model: GLMModel, prompt: str, max_new_tokens: int, temperature: float,
                  generator: torch.Generator, on_text: Callable[[str], None],
                  stop: Callable[[list[int]], bool] | None = None) -> str:
    """One completion decoded token by token with the model's caches; `on_text` gets each new piece of text."""
    if not prompt:
        raise ValueError("the prompt is empty: give some text to continue (--prompt) or a task (--task FAMILY)")
    ids = torch.tensor([TOK.encode(prompt, bos=True)])
    model.check_ids(ids)
    budget = min(max_new_tokens, model.cfg.max_seq_len - ids.shape[1])
    if budget < 1:
        raise ValueError(f"the prompt has {ids.shape[1]} tokens; the model's context is {model.cfg.max_seq_len}")
    cache = model.new_cache(1)
    logits = model(ids, valid=torch.ones_like(ids, dtype=torch.bool), cache=cache).logits[:, -1]
    tokens: list[int] = []
    shown = ""
    for _ in range(budget):
        logits[:, list(BANNED)] = float("-inf")
        tok, _ = sample_next(logits, temperature, None, None, generator)
        if int(tok) == TOK.eos_id:
            break
        tokens.append(int(tok))
        text = TOK.decode(tokens)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            on_text(text[len(shown):])
            shown = text
        if stop is not None and text.endswith("\n") and stop(tokens):
            break
        logits = model(tok[:, None], valid=torch.ones(1, 1, dtype=torch.bool), cache=cache).logits[:, -1]
    text = TOK.decode(tokens)
    on_text(text[len(shown):])
    return text


def task_prompts(args: argparse.Namespace) -> list[Any]:
    from glm_lightning.tasks.families import family_names, get_family
    from glm_lightning.tasks.task import make_tasks

    if args.task is not None:
        get_family(args.task)  # a clear error for an unknown family
        return make_tasks(args.split, max(1, args.per_family), [args.task], seed=args.seed)
    return make_tasks(args.split, args.per_family, list(family_names()), seed=args.seed)


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
    if args.prompt is not None and not args.prompt.strip():
        raise ValueError("the prompt is empty: give some text to continue (--prompt) or a task (--task FAMILY)")


def run(argv: Sequence[str], out: Callable[[str], None] | None = None) -> list[tuple[str, list[str], list[Any]]]:
    """Everything `main` does; returns (prompt, samples, verdicts) per prompt (verdicts empty for free prompts)."""
    args = build_parser().parse_args(list(argv))
    check_args(args)
    write = out or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    tasks = [] if args.prompt is not None else task_prompts(args)
    sys.stderr.write(describe_bf16() + "\n")
    model = sampling_weights(load_model(args.ckpt), args.precision)  # the one line every run logs about bf16 (README, "Precision")
    generator = torch.Generator().manual_seed(args.seed)
    verifier = VerifierSettings(workers=1).build() if tasks else None
    if verifier is not None:  # what isolates the samples here, or which promised protection is missing
        sys.stderr.write(verifier.summary() + "\n")
    results = []
    try:
        for task in tasks or [None]:
            prompt = args.prompt if task is None else task.prompt
            head = "prompt" if task is None else f"[{task.family}] {task.entry_point}"
            samples = []
            for k in range(args.num_samples):
                count = f", sample {k + 1}/{args.num_samples}" if args.num_samples > 1 else ""
                write(f"=== {head}{count} ===\n{prompt}")
                samples.append(stream_sample(model, prompt, args.max_new_tokens, args.temperature, generator, write,
                                             stop=completion_finished if task is not None else None))
                write("\n")
            verdicts = verifier.check_many(verifier_jobs([task] * len(samples), samples)) if task is not None else []
            for k, v in enumerate(verdicts):
                write(f"verdict {k + 1}/{len(verdicts)}: {v.status} ({v.passed_cases}/{v.total_cases} tests)\n")
            results.append((prompt, samples, verdicts))
    finally:
        if verifier is not None:
            verifier.close()
    return results


def main(argv: Sequence[str] | None = None) -> None:
    run(sys.argv[1:] if argv is None else argv)
