"""Evaluation plumbing shared by every stage and callback: sample completions for function tasks, build the
verifier jobs and score them in the sandbox, per-task outcomes (`TaskOutcomes`), pass rates, which families are
rewarded or monitored, and the DDP sharding of tasks and data (`shard`, `gather_sharded`, `rank_and_world`).

Model-written text never runs here: the verifier executes it in its own isolated processes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from glm_lightning.generation import generate
from glm_lightning.tasks.task import Task, make_tasks
from glm_lightning.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
VerifierJob = tuple[str, str, list[Any]]
"""(program text, entry point, hidden tests): what `Verifier.check_many` takes per sample."""


# --- the sandbox ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VerifierSettings:
    """Sandboxed verifier settings (see `docs/verifier.md`)."""

    workers: int = 2
    """Worker processes that run model-written code in parallel."""
    timeout_s: float = 2.0
    """Wall-clock limit of one check."""
    memory_mb: int = 256
    """Address-space limit of a worker."""

    def build(self) -> Any:
        """A fresh verifier with these settings (imported lazily: it starts processes)."""
        from glm_lightning.verifier import Verifier

        return Verifier(timeout_s=self.timeout_s, memory_mb=self.memory_mb, workers=self.workers)


def verifier_jobs(tasks: Sequence[Task], completions: Sequence[str]) -> list[VerifierJob]:
    """One job per (task, completion) pair: the prompt plus the completion is the program to check."""
    return [(t.prompt + c, t.entry_point, list(t.tests)) for t, c in zip(tasks, completions, strict=True)]


def module_verifier(pl_module: Any, own: dict[str, Any], settings: VerifierSettings) -> Any:
    """The module's verifier when it has one (RLModule, PretrainModule), else one owned by the caller in `own`."""
    shared = getattr(pl_module, "verifier", None)
    if shared is not None and hasattr(shared, "check_many"):
        return shared
    if own.get("verifier") is None:
        own["verifier"] = settings.build()
    return own["verifier"]


def close_own_verifier(own: dict[str, Any]) -> None:
    if own.get("verifier") is not None:
        own["verifier"].close()
        own["verifier"] = None


# --- sampling and scoring ---------------------------------------------------------------------------------------------
def completion_finished(tokens: list[int]) -> bool:
    """Cheap stop rule for one-function completions: a full `return ...` line has been written."""
    text = TOK.decode(tokens)
    lines = [ln for ln in text.split("\n") if ln.strip()]
    return text.endswith("\n") and bool(lines) and lines[-1].startswith("    return")


@dataclass
class Sampled:
    task: Task
    completions: list[str]


def sample_completions(model: torch.nn.Module, tasks: Sequence[Task], num_samples: int = 1, temperature: float = 0.0,
                       max_new_tokens: int = 48, batch_size: int = 32, generator: torch.Generator | None = None,
                       top_p: float | None = None, precision: str = "32") -> list[Sampled]:
    """`num_samples` completions per task (greedy when temperature is 0), prompts batched with left padding;
    `precision` "bf16" samples from a bf16 copy of the weights (`generation.sampling_weights`)."""
    out: list[Sampled] = []
    for start in range(0, len(tasks), batch_size):
        chunk = tasks[start:start + batch_size]
        ids, valid = TOK.encode_batch([t.prompt for t in chunk], bos=True)
        limit = min(max_new_tokens, model.cfg.max_seq_len - ids.shape[1])
        device = model.embed.weight.device
        gen = generate(model, ids.to(device), max_new_tokens=limit, temperature=temperature,
                       num_samples=num_samples, attention_mask=valid.to(device), generator=generator, top_p=top_p,
                       stop_fn=completion_finished, precision=precision)
        texts = [TOK.decode(row) for row in gen.tokens.cpu()]
        for i, t in enumerate(chunk):
            out.append(Sampled(t, texts[i * num_samples:(i + 1) * num_samples]))
    return out


def verify_samples(verifier: Any, sampled: Sequence[Sampled]) -> list[list[Any]]:
    """Verdicts per task per sample, all checked in one parallel batch."""
    pairs = [(s.task, c) for s in sampled for c in s.completions]
    verdicts = verifier.check_many(verifier_jobs([t for t, _ in pairs], [c for _, c in pairs]))
    out, i = [], 0
    for s in sampled:
        out.append(verdicts[i:i + len(s.completions)])
        i += len(s.completions)
    return out


def code_cell(text: str) -> str:
    """A completion as one Markdown table cell (TensorBoard text tables): one line, pipes escaped."""
    return "`" + text.strip().replace("|", "\\|").replace("\n", " ⏎ ") + "`"


def pass_rates(tasks: Sequence[Task], passed: Sequence[bool]) -> dict[str, float]:
    """Overall and per-family fraction of tasks passed: {"all": .., "<family>": ..}."""
    by_family: dict[str, list[bool]] = defaultdict(list)
    for t, ok in zip(tasks, passed):
        by_family[t.family].append(bool(ok))
    rates = {fam: sum(v) / len(v) for fam, v in sorted(by_family.items())}
    rates["all"] = sum(map(bool, passed)) / max(1, len(passed))
    return rates


@dataclass
class TaskOutcomes:
    """Per-task evaluation results, in task order."""

    tasks: list[Task]
    greedy: list[bool] = field(default_factory=list)
    """Greedy completion passed (empty when greedy decoding was not run)."""
    correct: list[int] = field(default_factory=list)
    """Passing samples out of `n_samples` (empty when no sampling was run)."""
    n_samples: int = 0
    greedy_text: list[str] = field(default_factory=list)


def evaluate_tasks(model: torch.nn.Module, tasks: Sequence[Task], verifier: Any, *, n_samples: int = 0,
                   greedy: bool = True, temperature: float = 0.35, top_p: float | None = None,
                   max_new_tokens: int = 48, seed: int = 0, max_rows: int = 256,
                   precision: str = "32") -> TaskOutcomes:
    """Greedy and/or `n_samples` sampled completions per task, verified in the sandbox; `precision` "bf16" samples
    from a bf16 copy of the weights."""
    tasks = list(tasks)
    out = TaskOutcomes(tasks=tasks, n_samples=n_samples)
    if not tasks:
        return out
    if greedy:
        sampled = sample_completions(model, tasks, num_samples=1, temperature=0.0, max_new_tokens=max_new_tokens,
                                     precision=precision)
        verdicts = verify_samples(verifier, sampled)
        out.greedy = [v[0].status == "passed" for v in verdicts]
        out.greedy_text = [s.completions[0] for s in sampled]
    if n_samples > 0:
        device = next(model.parameters()).device
        gen = torch.Generator(device=device).manual_seed(seed)
        sampled = sample_completions(model, tasks, num_samples=n_samples, temperature=temperature,
                                     max_new_tokens=max_new_tokens, batch_size=max(1, max_rows // n_samples),
                                     generator=gen, top_p=top_p, precision=precision)
        verdicts = verify_samples(verifier, sampled)
        out.correct = [sum(v.status == "passed" for v in vs) for vs in verdicts]
    return out


# --- which tasks, which families --------------------------------------------------------------------------------------
def resolve_eval_tasks(trainer: Any, split: str | None, per_family: int | None,
                       families: Sequence[str] | None, seed: int) -> list[Task]:
    """Evaluation tasks: explicit (families + per_family) or from the datamodule's `eval_tasks`."""
    dm = getattr(trainer, "datamodule", None)
    if hasattr(dm, "eval_tasks"):
        return dm.eval_tasks(split, per_family, families)
    if families is None or per_family is None:
        raise ValueError("this datamodule has no eval_tasks(); give the callback `families` and `per_family`")
    return make_tasks(split or "dev", per_family, list(families), seed=seed)


def family_roles(trainer: Any) -> dict[str, str]:
    """family -> `rewarded` / `monitor`, when the datamodule declares them."""
    dm = getattr(trainer, "datamodule", None)
    roles = {f: "rewarded" for f in getattr(dm, "train_families", ())}
    roles.update({f: "monitor" for f in getattr(dm, "monitor_families", ())})
    return roles


# --- DDP: who serves what ---------------------------------------------------------------------------------------------
def rank_and_world(owner: Any) -> tuple[int, int]:
    """(global rank, world size) of the Trainer attached to `owner` (a DataModule or LightningModule); (0, 1) alone."""
    trainer = getattr(owner, "trainer", None)
    if trainer is None:
        return 0, 1
    return trainer.global_rank, trainer.world_size


def shard(items: Sequence[Any], trainer: Any) -> list[Any]:
    """This rank's share r, r+W, ... of `items`."""
    if trainer is None or trainer.world_size <= 1:
        return list(items)
    return list(items)[trainer.global_rank::trainer.world_size]


def gather_sharded(trainer: Any, local: Sequence[float], total: int) -> list[float]:
    """Inverse of `shard` for per-item numbers: every rank gets all `total` values in the original order."""
    if trainer is None or trainer.world_size <= 1:
        return list(local)
    world = trainer.world_size
    width = math.ceil(total / world)
    buf = torch.full((width,), float("nan"), dtype=torch.float64)
    buf[: len(local)] = torch.tensor(list(local), dtype=torch.float64)
    gathered = trainer.strategy.all_gather(buf.to(trainer.strategy.root_device)).cpu().view(world, width)
    return gathered.t().reshape(-1)[:total].tolist()
