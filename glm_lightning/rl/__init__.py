"""RL post-training pieces apart from the Lightning stage (`glm_lightning.modules.rl.RLModule`): the pure maths
(`loss`), the grouped settings LightningCLI parses (`config`) and the rollout record with its logging (`rollouts`).
"""

from glm_lightning.rl.config import PolicyLoss, Reward, Sampling
from glm_lightning.rl.loss import (
    aggregate_loss,
    build_sequences,
    completion_logprobs,
    compute_advantages,
    token_losses,
    verdict_reward,
)
from glm_lightning.rl.rollouts import Rollouts

__all__ = [
    "PolicyLoss",
    "Reward",
    "Rollouts",
    "Sampling",
    "aggregate_loss",
    "build_sequences",
    "completion_logprobs",
    "compute_advantages",
    "token_losses",
    "verdict_reward",
]
