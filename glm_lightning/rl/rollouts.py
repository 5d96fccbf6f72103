"""One RL step's samples (`Rollouts`) and what is logged about them: the scalar step metrics, the TensorBoard
text table and the `rollouts.jsonl` records. Kept apart from the stage module so that it reads as the algorithm.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from glm_lightning.evaluation import code_cell
from glm_lightning.tasks.task import Task

VERDICT_STATUSES = ("passed", "failed", "invalid", "timeout", "error", "unscorable")
TABLE_ROWS = 8
"""Rows of the `samples/rollouts` text table."""


@dataclass
class Rollouts:
    """One step's samples, group-major: sample j of prompt i is row i * G + j."""

    tasks: list[Task]
    prompt_ids: list[list[int]]
    """Per prompt: `<bos> prompt` token ids."""
    completion_ids: list[list[int]]
    """Per sample: generated tokens (including eos when emitted)."""
    texts: list[str]
    sampler_logprobs: list[list[float]]
    truncated: list[bool]
    group_size: int

    def task_of(self, row: int) -> Task:
        return self.tasks[row // self.group_size]


def _status(verdict: Any) -> str:
    return "unscorable" if verdict is None else verdict.status


def step_metrics(rollouts: Rollouts, verdicts: Sequence[Any], rewards: torch.Tensor,
                 keep: torch.Tensor) -> dict[str, float]:
    """Reward, pass-rate (overall and per family), verdict mix and completion-shape scalars of one step."""
    n = len(rollouts.texts)
    flat = rewards.flatten()
    scored = flat[~torch.isnan(flat)]
    passed = [_status(v) == "passed" for v in verdicts]
    statuses = Counter(_status(v) for v in verdicts)
    logs = {
        "train/reward_mean": float(scored.mean()) if scored.numel() else float("nan"),
        "train/reward_std": float(scored.std()) if scored.numel() > 1 else 0.0,
        "train/pass_rate": sum(passed) / n,
        "train/frac_reward_zero_std": float((~keep).float().mean()),
        "train/completion_len": sum(len(c) for c in rollouts.completion_ids) / n,
        "train/truncated_frac": sum(rollouts.truncated) / n,
    }
    for status in VERDICT_STATUSES:
        logs[f"train/verdict/{status}"] = statuses.get(status, 0) / n
    by_family: dict[str, list[int]] = defaultdict(list)
    for i in range(n):
        by_family[rollouts.task_of(i).family].append(i)
    for fam, idx in sorted(by_family.items()):
        logs[f"train/pass_rate/{fam}"] = sum(passed[i] for i in idx) / len(idx)
        fam_r = flat[idx]
        fam_r = fam_r[~torch.isnan(fam_r)]
        if fam_r.numel():
            logs[f"train/reward/{fam}"] = float(fam_r.mean())
    return logs


def rollout_table(rollouts: Rollouts, verdicts: Sequence[Any], rewards: torch.Tensor,
                  advantages: torch.Tensor, rows: int = TABLE_ROWS) -> str:
    """Markdown table of the first `rows` samples (task, reward, advantage, verdict, completion)."""
    r, a = rewards.flatten(), advantages.flatten()
    lines = ["| task | reward | adv | verdict | completion |", "|---|---|---|---|---|"]
    for i in range(min(rows, len(rollouts.texts))):
        v = verdicts[i]
        verdict = "unscorable" if v is None else f"{v.status} ({v.passed_cases}/{v.total_cases})"
        lines.append(f"| `{rollouts.task_of(i).entry_point}` | {float(r[i]):.2f} | {float(a[i]):+.2f} | {verdict} "
                     f"| {code_cell(rollouts.texts[i])} |")
    return "\n".join(lines)


def append_rollouts(path: Path, step: int, rollout_step: int, rollouts: Rollouts, verdicts: Sequence[Any],
                    rewards: torch.Tensor, advantages: torch.Tensor) -> None:
    """Append one JSON line per sample (step, task, completion, reward, advantage, verdict) to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    flat_r, flat_a = rewards.flatten().tolist(), advantages.flatten().tolist()
    with open(path, "a", encoding="utf-8") as fh:
        for i, text in enumerate(rollouts.texts):
            task, v = rollouts.task_of(i), verdicts[i]
            fh.write(json.dumps({
                "step": step, "rollout_step": rollout_step, "task_id": task.task_id,
                "family": task.family, "entry_point": task.entry_point, "sample": i % rollouts.group_size,
                "completion": text, "reward": None if math.isnan(flat_r[i]) else flat_r[i],
                "advantage": flat_a[i], "truncated": rollouts.truncated[i],
                "length": len(rollouts.completion_ids[i]), "status": _status(v),
                "passed_cases": None if v is None else v.passed_cases,
                "total_cases": None if v is None else v.total_cases,
                "detail": "" if v is None else v.detail[:200],
            }) + "\n")
