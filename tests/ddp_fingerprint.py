"""Helpers for the DDP test: a callback writing each rank's weight fingerprint, an RL module with a stand-in reward."""

from __future__ import annotations

import json
import os
from pathlib import Path

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch

from glm_lightning.modules.rl import RLModule
from glm_lightning.rl.rollouts import Rollouts


def _fingerprint(module: torch.nn.Module) -> list[float]:
    return [float(p.detach().double().sum()) for p in module.parameters()]


class WeightFingerprint(pl.Callback):
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = _fingerprint(pl_module.model)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        out = Path(os.environ["GLM_FINGERPRINT_DIR"]) / f"fingerprint-rank{trainer.global_rank}.json"
        biases = [float(b.double().sum()) for n, b in pl_module.model.named_buffers() if n.endswith("expert_bias")]
        out.write_text(json.dumps({"rank": trainer.global_rank, "world_size": trainer.world_size,
                                   "global_step": trainer.global_step, "start": self.start,
                                   "weights": _fingerprint(pl_module.model), "expert_bias": biases}))


class LengthRewardRL(RLModule):
    """RL with a stand-in reward (completion length parity) so that a random tiny model's groups have variance and
    the DDP update path (gradient all-reduce, global token normaliser) really runs; the verifier still scores."""

    def rewards(self, rollouts: Rollouts, verdicts: Sequence[Any]) -> torch.Tensor:
        r = [float(len(ids) % 2) + 0.1 * i for i, ids in enumerate(rollouts.completion_ids)]
        return torch.tensor(r, dtype=torch.float32).view(-1, rollouts.group_size)
