"""The RL stage's settings, grouped by what they steer; LightningCLI parses each group from YAML
(`model.init_args.sampling.temperature`), and the attribute docstrings are the `--help` text. Each group checks its
own values when it is built, so a bad config fails before any model exists. Meanings and defaults: `docs/rl.md`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from glm_lightning.rl.loss import AGGREGATIONS, ESTIMATORS, REWARDS


@dataclass(frozen=True)
class Sampling:
    """How rollouts are drawn."""

    group_size: int = 8
    """G completions per prompt (>= 2: the group baselines need at least two)."""
    temperature: float = 0.35
    """Sampling temperature (> 0); the trained policy's is `loss.train_temperature` (default: this one)."""
    top_p: float | None = None
    """Nucleus sampling threshold in (0, 1]; null = off."""
    max_new_tokens: int = 48
    """Completion budget; longer completions are truncated (and logged as such)."""
    seed: int = 0
    """Base seed of the per-step sampling generator (combined with epoch, batch and rank)."""
    precision: str = "32"
    """Weights the rollouts sample from: `32` (the policy's fp32 weights) or `bf16` (a bf16 copy of its matrices,
    refreshed after every optimizer step; README, "Precision")."""

    def __post_init__(self) -> None:
        g = self.group_size
        if isinstance(g, bool) or not isinstance(g, int) or g < 2:
            raise ValueError(f"group_size (G) must be an int >= 2: group baselines need at least two samples per "
                             f"prompt; got {g!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 for RL sampling (0 would make every group identical), "
                             f"got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        from glm_lightning.generation import check_precision

        object.__setattr__(self, "precision", check_precision(self.precision))


@dataclass(frozen=True)
class Reward:
    """How a verdict becomes a scalar reward."""

    kind: str = "binary"
    """`binary` (1 pass / 0 fail) or `partial` (fraction of hidden tests passed)."""
    invalid_penalty: float = -0.1
    """Reward of invalid, timed-out or crashing code (e.g. 0, -0.1, -1)."""
    format_bonus: float = 0.0
    """Added when the code compiles, defines the function and was not truncated."""

    def __post_init__(self) -> None:
        if self.kind not in REWARDS:
            raise ValueError(f"unknown reward {self.kind!r}; choose one of {REWARDS}")


@dataclass(frozen=True)
class PolicyLoss:
    """Advantages and the clipped policy-gradient loss."""

    advantage: str = "rloo"
    """`rloo` (leave-one-out baseline), `grpo` ((r - mean) / (std + eps)) or `dr_grpo` (r - mean)."""
    std_eps: float = 1e-4
    """Epsilon of the GRPO std division."""
    aggregation: str = "token"
    """`token` (sum / completion tokens of the step) or `sequence` (mean of per-sequence means)."""
    kl_coef: float = 0.0
    """beta of the k3 KL to a frozen copy of the starting policy (0 = no reference model)."""
    clip_eps: float = 0.2
    """Lower PPO ratio clip: ratios below 1 - clip_eps are clipped."""
    clip_eps_high: float | None = None
    """Upper PPO ratio clip 1 + clip_eps_high (null = clip_eps)."""
    ppo_epochs: int = 1
    """Optimizer steps over the same rollouts (1 = on-policy; the clip is then inert)."""
    train_temperature: str | float = "sampling"
    """Temperature of the trained log-probs log_softmax(logits / T): `sampling` (the rollout temperature, the policy
    that was sampled) or a number, e.g. 1.0 (the tutorial's train_rl.py trains log_softmax(logits) whatever the
    rollout temperature)."""

    def trained_temperature(self, sampling_temperature: float) -> float:
        """The T of the trained log-probs for rollouts sampled at `sampling_temperature`."""
        return float(sampling_temperature if self.train_temperature == "sampling" else self.train_temperature)

    def __post_init__(self) -> None:
        if self.advantage not in ESTIMATORS:
            raise ValueError(f"unknown advantage estimator {self.advantage!r}; choose one of {ESTIMATORS}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown loss_aggregation {self.aggregation!r}; choose one of {AGGREGATIONS}")
        if self.ppo_epochs < 1:
            raise ValueError("ppo_epochs must be >= 1")
        high = self.clip_eps_high
        t = self.train_temperature
        if t != "sampling":
            try:  # a command line may hand over "1.0" as text
                value = float(t) if not isinstance(t, bool) else math.nan
            except (TypeError, ValueError):
                value = math.nan
            if not value > 0:
                raise ValueError(f"train_temperature must be 'sampling' or a number > 0, got {t!r}")
            object.__setattr__(self, "train_temperature", value)
        if self.kl_coef < 0 or self.clip_eps <= 0 or (high is not None and high <= 0) or self.std_eps <= 0:
            raise ValueError("need kl_coef >= 0, clip_eps > 0, clip_eps_high > 0 and std_eps > 0")
