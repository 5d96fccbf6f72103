"""Generate completions for function tasks and score them in the sandboxed verifier.

Shared by pre-training (`val/dev_pass`), the pass@k callback and RL. The model's text never runs here: the verifier
executes it in its own isolated processes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from glm_lightning.generation import generate
from glm_lightning.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def completion_finished(tokens: list[int]) -> bool:
    """Cheap stop rule for one-function completions: a full `return ...` line has been written."""
    text = TOK.decode(tokens)
    lines = [ln for ln in text.split("\n") if ln.strip()]
    return text.endswith("\n") and bool(lines) and lines[-1].startswith("    return")


@dataclass
class Sampled:
    task: Any
    completions: list[str]


def sample_completions(model: torch.nn.Module, tasks: Sequence[Any], num_samples: int = 1, temperature: float = 0.0,
                       max_new_tokens: int = 48, batch_size: int = 32, generator: torch.Generator | None = None,
                       top_p: float | None = None) -> list[Sampled]:
    """`num_samples` completions per task (greedy when temperature is 0), prompts batched with left padding."""
    out: list[Sampled] = []
    for start in range(0, len(tasks), batch_size):
        chunk = tasks[start:start + batch_size]
        ids, _ = TOK.encode_batch([t.prompt for t in chunk], bos=True)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        for row, t in enumerate(chunk):
            n = len(TOK.encode(t.prompt)) + 1
            mask[row, ids.shape[1] - n:] = True
        limit = min(max_new_tokens, model.cfg.max_seq_len - ids.shape[1])
        gen = generate(model, ids.to(model.embed.weight.device), max_new_tokens=limit, temperature=temperature,
                       num_samples=num_samples, attention_mask=mask, generator=generator, top_p=top_p,
                       stop_fn=completion_finished)
        texts = [TOK.decode(row) for row in gen.tokens.cpu()]
        for i, t in enumerate(chunk):
            out.append(Sampled(t, texts[i * num_samples:(i + 1) * num_samples]))
    return out


def verify_samples(verifier: Any, sampled: Sequence[Sampled]) -> list[list[Any]]:
    """Verdicts per task per sample, all checked in one parallel batch."""
    jobs = [(s.task.prompt + c, s.task.entry_point, list(s.task.tests)) for s in sampled for c in s.completions]
    verdicts = verifier.check_many(jobs)
    out, i = [], 0
    for s in sampled:
        out.append(verdicts[i:i + len(s.completions)])
        i += len(s.completions)
    return out


def pass_rates(tasks: Sequence[Any], passed: Sequence[bool]) -> dict[str, float]:
    """Overall and per-family fraction of tasks passed: {"all": .., "<family>": ..}."""
    by_family: dict[str, list[bool]] = defaultdict(list)
    for t, ok in zip(tasks, passed):
        by_family[t.family].append(bool(ok))
    rates = {fam: sum(v) / len(v) for fam, v in sorted(by_family.items())}
    rates["all"] = sum(map(bool, passed)) / max(1, len(passed))
    return rates
