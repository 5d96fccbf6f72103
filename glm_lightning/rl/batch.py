"""The update's input (`UpdateBatch`): the informative groups of one RL step, padded once and split into micro-batches
of whole groups. Kept apart from the stage module so that `glm_lightning/modules/rl.py` reads as the algorithm."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm_lightning.rl.loss import grouped_completion_logprobs


@dataclass
class UpdateBatch:
    """The groups whose samples enter the loss: each prompt once (left-padded) and its G completions
    (right-padded), split into micro-batches of whole groups (`grouped_completion_logprobs` runs a prompt once)."""

    rows: list[int]
    prompt_ids: torch.Tensor
    """[groups, Tp] left-padded prompts."""
    prompt_valid: torch.Tensor
    completions: torch.Tensor
    """[rows, Tc] right-padded completions; row j belongs to prompt j // G."""
    mask: torch.Tensor
    """[rows, Tc] True on the completion tokens (the loss positions)."""
    advantages: torch.Tensor
    normalizer: float
    chunks: list[tuple[slice, slice]]
    """Per micro-batch: (its prompts, its rows)."""

    @property
    def n_tokens(self) -> float:
        return float(self.mask.sum())

    def logprobs(self, model: torch.nn.Module, chunk: tuple[slice, slice],
                 temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        groups, rows = chunk
        return grouped_completion_logprobs(model, self.prompt_ids[groups], self.prompt_valid[groups],
                                           self.completions[rows], self.mask[rows], temperature)
