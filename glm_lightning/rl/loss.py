"""Pure RL maths of the RL stage (no Lightning, no verifier): reward of a verdict, group-relative advantages
(RLOO / GRPO / Dr. GRPO), the clipped per-token policy loss with a k3 KL term, its aggregation, teacher-forced
completion log-probs and the teacher-forcing rows they are computed on. Unit-tested on hand-made inputs
(`tests/test_rl.py`); the formulas are written out in `docs/rl.md`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from glm_lightning.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
REWARDS = ("binary", "partial")
ESTIMATORS = ("rloo", "grpo", "dr_grpo")
AGGREGATIONS = ("token", "sequence")
INVALID_STATUSES = ("invalid", "timeout", "error")


def verdict_reward(verdict: Any, reward: str = "binary", invalid_penalty: float = -0.1, format_bonus: float = 0.0,
                   truncated: bool = False) -> float:
    """Scalar reward of one verdict: NaN when unscorable (None), `invalid_penalty` for invalid/timeout/error,
    else 1 / 0 (`binary`) or the fraction of tests passed (`partial`), plus `format_bonus` unless truncated."""
    if verdict is None:
        return float("nan")  # unscorable (verifier infrastructure failure)
    if verdict.status in INVALID_STATUSES:
        return float(invalid_penalty)
    if reward == "binary":
        base = 1.0 if verdict.status == "passed" else 0.0
    elif reward == "partial":
        base = 1.0 if verdict.status == "passed" else (
            verdict.passed_cases / verdict.total_cases if verdict.total_cases else 0.0)
    else:
        raise ValueError(f"unknown reward {reward!r}; choose one of {REWARDS}")
    return base + (0.0 if truncated else float(format_bonus))


def compute_advantages(rewards: torch.Tensor, estimator: str = "rloo", eps: float = 1e-4,
                       zero_std_tol: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages [P, G] for rewards [P, G] (one row per prompt group) and a keep mask [P] of informative groups.

    NaN rewards (unscorable samples) are left out of the group statistics and get advantage 0. A group is dropped
    (keep False, advantages 0) when fewer than 2 samples are scorable or all scorable rewards are equal.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {ESTIMATORS}")
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [num_groups, G] with G >= 2, got {tuple(rewards.shape)}")
    r = rewards.double()
    ok = ~torch.isnan(r)
    n = ok.sum(1, keepdim=True).double()
    rz = torch.where(ok, r, torch.zeros_like(r))
    total = rz.sum(1, keepdim=True)
    mean = total / n.clamp(min=1)
    hi = torch.where(ok, r, torch.full_like(r, -math.inf)).amax(1)
    lo = torch.where(ok, r, torch.full_like(r, math.inf)).amin(1)
    keep = (n.squeeze(1) >= 2) & ((hi - lo) > zero_std_tol)
    if estimator == "rloo":
        adv = rz - (total - rz) / (n - 1).clamp(min=1)
    elif estimator == "dr_grpo":
        adv = rz - mean
    else:
        var = (torch.where(ok, r - mean, torch.zeros_like(r)) ** 2).sum(1, keepdim=True) / (n - 1).clamp(min=1)
        adv = (rz - mean) / (var.sqrt() + eps)
    adv = torch.where(ok & keep[:, None], adv, torch.zeros_like(adv))
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32), keep


def token_losses(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                 ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0, clip_eps: float = 0.2,
                 clip_eps_high: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped policy-gradient loss (+ beta * k3 KL). Shapes [N, T]; advantages [N].

    Returns (loss [N, T], clipped [N, T] bool: the clipped branch is the active one, kl [N, T] (0 without a ref)).
    """
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None].to(logp.dtype)
    surr = ratio * adv
    clipped_ratio = ratio.clamp(1.0 - clip_eps, 1.0 + (clip_eps if clip_eps_high is None else clip_eps_high))
    surr_clip = clipped_ratio * adv
    loss = -torch.minimum(surr, surr_clip)
    clipped = surr_clip < surr
    if ref_logp is not None:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1.0
        loss = loss + kl_coef * kl
    else:
        kl = torch.zeros_like(logp)
    return loss, clipped, kl


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, normalizer: float) -> torch.Tensor:
    """Sum of this micro-batch's share of the step loss.

    `token`: sum over masked tokens / `normalizer` (= completion tokens in the whole step).
    `sequence`: sum over sequences of the per-sequence token mean / `normalizer` (= sequences in the step).
    """
    m = mask.to(loss.dtype)
    if mode == "token":
        return (loss * m).sum() / max(normalizer, 1.0)
    if mode == "sequence":
        return ((loss * m).sum(1) / m.sum(1).clamp(min=1)).sum() / max(normalizer, 1.0)
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {AGGREGATIONS}")


def completion_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, targets: torch.Tensor,
                        temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forced log-probs of `targets` [N, T] under softmax(logits / temperature), the per-position entropy
    (detached) and the model's aux loss."""
    out = model(input_ids)
    logits = out.logits.float() / temperature
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy, out.aux_loss


def grouped_completion_logprobs(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_valid: torch.Tensor,
                                completions: torch.Tensor, completion_valid: torch.Tensor, temperature: float = 1.0
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`completion_logprobs` for G completions of each prompt, running each prompt once instead of G times.

    The prompts ([P, Tp], left-padded, `prompt_valid` bool) are prefilled into a decoding cache, the cache is
    replicated G = N / P times, and the completions ([N, Tc], right-padded, `completion_valid` bool) continue from
    it, as in generation. Gradients reach the prompt's share of every trainable layer through the replicated
    cache. In RL the prompt is most of each row, so this runs the model on about half the tokens.
    Returns logp [N, Tc] (of `completions` itself), entropy [N, Tc] (detached) and the aux loss (the two calls'
    aux losses weighted by their lengths: close to, not equal to, the full rows' aux loss).
    """
    p, n = prompt_ids.shape[0], completions.shape[0]
    if n % p:
        raise ValueError(f"{n} completions do not split into groups of the {p} prompts")
    g = n // p
    cache = model.new_cache(p)
    first = model(prompt_ids, valid=prompt_valid, cache=cache)
    logits, aux = first.logits[:, -1:].repeat_interleave(g, 0), first.aux_loss
    if completions.shape[1] > 1:
        cache = cache.repeat_interleave(g)
        rest = model(completions[:, :-1], valid=completion_valid[:, :-1], cache=cache)
        logits = torch.cat([logits, rest.logits], 1)
        tp, tc = prompt_ids.shape[1], completions.shape[1] - 1  # aux terms are means: weigh the calls by length
        aux = (tp * aux + tc * rest.aux_loss) / (tp + tc)
    logp_all = (logits.float() / temperature).log_softmax(-1)
    logp = logp_all.gather(-1, completions.clamp(min=0)[..., None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy, aux


def pad_completions(completions: Sequence[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded completion ids [N, Tc] and their bool mask (True on real tokens; every row needs >= 1)."""
    width = max(len(c) for c in completions)
    ids = torch.full((len(completions), width), TOK.pad_id, dtype=torch.long)
    mask = torch.zeros((len(completions), width), dtype=torch.bool)
    for i, c in enumerate(completions):
        ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        mask[i, : len(c)] = True
    return ids, mask


def build_sequences(prompts: Sequence[list[int]], completions: Sequence[list[int]]) -> tuple[torch.Tensor, ...]:
    """Right-padded teacher-forcing rows for `prompt + completion` token lists.

    Returns input_ids [N, T], targets [N, T] (pad where ignored) and mask [N, T] (True on completion targets).
    """
    rows = [list(p) + list(c) for p, c in zip(prompts, completions)]
    width = max(len(r) for r in rows) - 1
    n = len(rows)
    ids = torch.full((n, width), TOK.pad_id, dtype=torch.long)
    targets = torch.full((n, width), TOK.pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, rows)):
        ids[i, : len(r) - 1] = torch.tensor(r[:-1])
        targets[i, : len(r) - 1] = torch.tensor(r[1:])
        mask[i, len(p) - 1: len(r) - 1] = True
    return ids, targets, mask
