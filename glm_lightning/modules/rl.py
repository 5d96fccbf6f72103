"""RLModule: group-relative policy-gradient post-training (GRPO / RLOO / Dr. GRPO) on executable function tasks.

One training step (manual optimization):

1. **Rollout.** Take a batch of prompts and sample a group of G completions per prompt with the cached generator
   (temperature T, top-p, `max_new_tokens`; a completion stops at eos or once a full `return` line is written).
2. **Score.** Run every `prompt + completion` through the sandboxed verifier in one parallel `check_many` call.
   Reward = `binary` (1 pass / 0 fail) or `partial` (fraction of hidden tests passed); `invalid`, `timeout` and
   `error` verdicts get `invalid_penalty` instead; `format_bonus` is added to completions that compile, define the
   function and were not truncated. A verifier *infrastructure* failure (the whole `check_many` call raising) never
   stops the run: those samples are unscorable (reward NaN, advantage 0, counted in `train/verifier_failures`), and
   a fresh verifier is started for the next step. Model-written code never runs in this process.
3. **Advantages** per group: `rloo` r_i - mean_{j!=i} r_j; `grpo` (r_i - mean) / (std + eps) (Bessel std);
   `dr_grpo` r_i - mean. Groups whose rewards are all equal carry no signal: they are skipped (no forward, no
   loss; KL too) and counted (`train/frac_reward_zero_std`, `train/groups_skipped`).
4. **Update.** A teacher-forced forward of `<bos> prompt completion` recomputes the log-probs of the completion
   tokens under the *tempered* policy softmax(logits / T) (the distribution that was sampled, as TRL does).
   Per token: `-min(rho A, clip(rho, 1-eps, 1+eps_high) A) + beta * k3(ref || policy)` with
   `rho = exp(logp - logp_old)`. Aggregation `token` = sum over tokens / completion tokens in the step (DAPO; no
   length bias) or `sequence` = mean over sequences of the per-sequence token mean (the tutorial's form). With
   `ppo_epochs = 1` the rollouts are used once, rho == 1 and clipping is inert (the loss value is ~0 while its
   gradient is the REINFORCE-with-baseline gradient: watch the reward, not the loss). With `ppo_epochs > 1` the
   same rollouts are reused for several optimizer steps, `logp_old` = the log-probs of the first pass, and the
   clip is active. The model's aux loss (MoE balance + DSA indexer KL; only trainable layers receive gradient) is
   added with `aux_loss_weight`.

Design choices (documented here because they change results):

- **Trainable scope** comes from `callbacks.freeze.FreezeCallback`; `configs/rl.yaml` trains the last block, the
  final norm and the output head, as the tutorial did. Without a freezing callback every parameter trains.
- **Tied embedding.** With the tied head, "train the head" also moves the input embedding, i.e. the inputs of all
  frozen layers; the tutorial saw interference on untrained families that way. `untie_head: true` (the default)
  calls `model.untie_head()`: the head gets its own copy of the embedding matrix and trains, while the input
  embedding stays frozen. An RL checkpoint then holds `model.lm_head.weight`; loading one via `init_weights` unties
  automatically.
- **MoE balance bias.** Not updated during RL by default (`balance_bias_update: false`): routing of frozen layers
  must not drift, and the small RL batches give noisy load estimates. With `balance_bias_update: true`, only MoE
  layers that have trainable parameters take the bias step after each optimizer step.
- **KL.** `kl_coef > 0` keeps a frozen copy of the starting policy (`ref_model`, saved in checkpoints so resumed
  runs keep the same reference) and adds beta * k3 per token (k3 = exp(d) - d - 1, d = logp_ref - logp >= 0).
- `max_steps` counts optimizer steps: one per training batch with an active group, times `ppo_epochs`.

Logs (every step): `train/reward_mean|std`, `train/pass_rate` (+ per family), `train/frac_reward_zero_std`,
`train/kl`, `train/entropy`, `train/completion_len`, `train/truncated_frac`, `train/clip_frac`, `train/verdict/*`,
`train/logprob_gap` (sampler vs trainer log-prob), `time/generate_s|verify_s|update_s`; a TensorBoard text table
`samples/rollouts` every `log_samples_every_n_steps`; and `rollouts.jsonl` (every rollout: step, prompt id,
completion, reward, advantage, verdict) in the logger's log_dir. Validation logs `val/ref_nll` (teacher-forced
NLL per byte of the reference completions of the eval tasks, overall and per family); pass@k and regression
checks are callbacks (`callbacks/pass_at_k.py`, `callbacks/regression.py`).
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.loggers.logger import DummyLogger

from datamodules.rl_prompts import record_task
from glm_lightning.evaluation import completion_finished
from glm_lightning.generation import generate
from glm_lightning.modules.base import GLMTaskModule, load_model_checkpoint
from glm_lightning.tasks.task import Task
from glm_lightning.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
REWARDS = ("binary", "partial")
ESTIMATORS = ("rloo", "grpo", "dr_grpo")
AGGREGATIONS = ("token", "sequence")
INVALID_STATUSES = ("invalid", "timeout", "error")


# --- pure RL math (unit-tested on hand-made inputs) -------------------------------------------------------------------
def verdict_reward(verdict: Any, reward: str = "binary", invalid_penalty: float = -0.1, format_bonus: float = 0.0,
                   truncated: bool = False) -> float:
    """Scalar reward of one verdict (see module docstring)."""
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


# --- rollouts ---------------------------------------------------------------------------------------------------------
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


class RLModule(GLMTaskModule):
    """RL post-training stage (see the module docstring for the algorithm, options and logs)."""

    def __init__(
        self,
        preset: str = "flash-25m",
        model_overrides: dict[str, Any] | None = None,
        init_weights: str | None = None,
        lr: float = 5e-5,
        min_lr_ratio: float = 1.0,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        group_size: int = 8,
        temperature: float = 0.35,
        top_p: float | None = None,
        max_new_tokens: int = 48,
        reward: str = "binary",
        invalid_penalty: float = -0.1,
        format_bonus: float = 0.0,
        advantage: str = "rloo",
        std_eps: float = 1e-4,
        loss_aggregation: str = "token",
        kl_coef: float = 0.0,
        clip_eps: float = 0.2,
        clip_eps_high: float | None = None,
        ppo_epochs: int = 1,
        mask_truncated: bool = False,
        aux_loss_weight: float = 1.0,
        grad_clip: float = 1.0,
        micro_batch_size: int | None = None,
        untie_head: bool = True,
        balance_bias_update: bool = False,
        sampling_seed: int = 0,
        verifier_workers: int = 2,
        verifier_timeout_s: float = 2.0,
        verifier_memory_mb: int = 256,
        samples_in_log: int = 8,
        log_samples_every_n_steps: int = 10,
        rollout_log: bool = True,
    ) -> None:
        """
        Args:
            preset, model_overrides, init_weights, lr, min_lr_ratio, weight_decay, betas, warmup_steps: as in
                `GLMTaskModule` (init_weights: a checkpoint of any stage with the same model config).
            group_size: G completions per prompt (>= 2: the baselines need at least two).
            temperature: sampling temperature (> 0); also the temperature of the trained policy.
            top_p: nucleus sampling (None = off).
            max_new_tokens: completion budget; longer completions are truncated (and logged as such).
            reward: `binary` or `partial`.
            invalid_penalty: reward of invalid / timed-out / crashing code (e.g. 0, -0.1, -1).
            format_bonus: added when the code compiles, defines the function and was not truncated.
            advantage: `rloo`, `grpo` or `dr_grpo`.
            std_eps: epsilon of the GRPO std division.
            loss_aggregation: `token` (sum / completion tokens of the step) or `sequence` (mean of per-sequence means).
            kl_coef: beta of the k3 KL to a frozen copy of the starting policy (0 = no reference model).
            clip_eps, clip_eps_high: PPO ratio clip range [1 - eps, 1 + eps_high] (eps_high None = eps).
            ppo_epochs: optimizer steps over the same rollouts (1 = on-policy; the clip is then inert).
            mask_truncated: drop truncated completions from the loss (their rewards still enter the baselines).
            aux_loss_weight: weight of the model's aux loss (MoE balance + DSA indexer KL) in the RL loss.
            grad_clip: max global grad norm (0 = off).
            micro_batch_size: rows per forward/backward (None = the whole step at once).
            untie_head: give the output head its own weights (train it while the input embedding stays frozen).
            balance_bias_update: take MoE balance-bias steps for MoE layers with trainable parameters.
            sampling_seed: base seed of the per-step sampling generator.
            verifier_workers, verifier_timeout_s, verifier_memory_mb: sandboxed verifier settings.
            samples_in_log: rows of the rollout text table; log_samples_every_n_steps: its period (0 = never).
            rollout_log: write `rollouts.jsonl` to the logger's log_dir.
        """
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
            raise ValueError(f"group_size (G) must be an int >= 2: group baselines need at least two samples per "
                             f"prompt; got {group_size!r}")
        if reward not in REWARDS:
            raise ValueError(f"unknown reward {reward!r}; choose one of {REWARDS}")
        if advantage not in ESTIMATORS:
            raise ValueError(f"unknown advantage estimator {advantage!r}; choose one of {ESTIMATORS}")
        if loss_aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown loss_aggregation {loss_aggregation!r}; choose one of {AGGREGATIONS}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 for RL sampling (0 would make every group identical), "
                             f"got {temperature}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
        if max_new_tokens < 1 or ppo_epochs < 1:
            raise ValueError("max_new_tokens and ppo_epochs must be >= 1")
        if kl_coef < 0 or clip_eps <= 0 or (clip_eps_high is not None and clip_eps_high <= 0) or std_eps <= 0:
            raise ValueError("need kl_coef >= 0, clip_eps > 0, clip_eps_high > 0 and std_eps > 0")
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError("micro_batch_size must be >= 1 or null")
        if grad_clip < 0 or aux_loss_weight < 0:
            raise ValueError("grad_clip and aux_loss_weight must be >= 0")
        super().__init__(preset, model_overrides, init_weights, lr, min_lr_ratio, weight_decay, betas, warmup_steps)
        self.save_hyperparameters()
        self.automatic_optimization = False
        if untie_head:
            self.model.untie_head()
        self.ref_model: torch.nn.Module | None = None
        if kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model)
            self.ref_model.requires_grad_(False)
        self._verifier = None
        self._rollout_steps = 0
        self._groups_skipped = 0
        self._groups_seen = 0
        self._verifier_failures = 0

    # --- weights -------------------------------------------------------------------------------------------------
    def load_model_weights(self, path: str | Path, strict: bool = True) -> None:
        """As the base class, but a checkpoint with its own output head (an untied RL run) unties this model first."""
        _, state = load_model_checkpoint(path)
        if "lm_head.weight" in state:
            self.model.untie_head()
        super().load_model_weights(path, strict)

    # --- verifier ------------------------------------------------------------------------------------------------
    @property
    def verifier(self) -> Any:
        if self._verifier is None:
            from glm_lightning.verifier import Verifier

            hp = self.hparams
            self._verifier = Verifier(timeout_s=hp.verifier_timeout_s, memory_mb=hp.verifier_memory_mb,
                                      workers=hp.verifier_workers)
        return self._verifier

    def teardown(self, stage: str) -> None:
        if self._verifier is not None:
            self._verifier.close()
            self._verifier = None

    # --- step 1: rollouts ----------------------------------------------------------------------------------------
    def rollout(self, tasks: Sequence[Task], generator: torch.Generator | None = None) -> Rollouts:
        """Sample G completions per task with the cached generator (no gradient)."""
        hp = self.hparams
        g = hp.group_size
        prompt_ids = [TOK.encode(t.prompt, bos=True) for t in tasks]
        width = max(len(p) for p in prompt_ids)
        device = self.model.embed.weight.device
        ids = torch.full((len(tasks), width), TOK.pad_id, dtype=torch.long)
        mask = torch.zeros((len(tasks), width), dtype=torch.bool)
        for i, p in enumerate(prompt_ids):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = True
        limit = min(hp.max_new_tokens, self.model.cfg.max_seq_len - width)
        if limit < 1:
            raise ValueError(f"prompt of {width} tokens leaves no room in the model context "
                             f"({self.model.cfg.max_seq_len})")
        gen = generate(self.model, ids.to(device), max_new_tokens=limit, temperature=hp.temperature,
                       top_p=hp.top_p, num_samples=g, attention_mask=mask.to(device), generator=generator,
                       stop_fn=completion_finished)
        tokens, lengths, lps = gen.tokens.cpu(), gen.lengths.cpu(), gen.logprobs.cpu()
        comp, texts, slp, trunc = [], [], [], []
        for row in range(tokens.shape[0]):
            toks = tokens[row, : int(lengths[row])].tolist()
            comp.append(toks)
            texts.append(TOK.decode(toks))
            slp.append(lps[row, : len(toks)].tolist())
            ended = (toks and toks[-1] == TOK.eos_id) or completion_finished(toks)
            trunc.append(not ended)
        return Rollouts(list(tasks), prompt_ids, comp, texts, slp, trunc, g)

    # --- step 2: scoring -----------------------------------------------------------------------------------------
    def score(self, rollouts: Rollouts) -> list[Any]:
        """Verdicts (one per sample) from the sandboxed verifier; None for every sample if the verifier itself
        failed (infrastructure error: the samples are unscorable and the verifier is restarted)."""
        jobs = [(rollouts.task_of(i).prompt + text, rollouts.task_of(i).entry_point, list(rollouts.task_of(i).tests))
                for i, text in enumerate(rollouts.texts)]
        try:
            return list(self.verifier.check_many(jobs))
        except Exception as exc:  # noqa: BLE001 - any sandbox breakage must not stop training
            self._verifier_failures += len(jobs)
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(f"verifier failed on a batch of {len(jobs)} samples ({type(exc).__name__}: {exc}); "
                           "they are treated as unscorable and the verifier is restarted")
            if self._verifier is not None:
                try:
                    self._verifier.close()
                finally:
                    self._verifier = None
            return [None] * len(jobs)

    def rewards(self, rollouts: Rollouts, verdicts: Sequence[Any]) -> torch.Tensor:
        hp = self.hparams
        r = [verdict_reward(v, hp.reward, hp.invalid_penalty, hp.format_bonus, t)
             for v, t in zip(verdicts, rollouts.truncated)]
        return torch.tensor(r, dtype=torch.float32).view(-1, rollouts.group_size)

    # --- step 3-4: update ----------------------------------------------------------------------------------------
    def update(self, rollouts: Rollouts, advantages: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
        """Policy-gradient optimizer step(s) on the informative groups; returns scalar statistics."""
        hp = self.hparams
        g = rollouts.group_size
        rows = [i for i in range(len(rollouts.texts)) if bool(keep[i // g])
                and not (hp.mask_truncated and rollouts.truncated[i])]
        stats: dict[str, float] = {}
        world = self.trainer.world_size if self._trainer is not None else 1
        any_rows = bool(rows)
        if world > 1:
            any_rows = self.trainer.strategy.reduce_boolean_decision(any_rows, all=False)
        if not any_rows:
            return stats
        weights = torch.ones(max(1, len(rows)))
        if not rows:  # under DDP another rank updates: join the backward with a zero-weight row
            rows, weights = [0], torch.zeros(1)
        device = self.model.embed.weight.device
        ids, targets, mask = build_sequences([rollouts.prompt_ids[i // g] for i in rows],
                                             [rollouts.completion_ids[i] for i in rows])
        mask = mask & (weights[:, None] > 0)
        ids, targets, mask = ids.to(device), targets.to(device), mask.to(device)
        adv = advantages.flatten()[rows].to(device)
        n_tokens = float(mask.sum())
        normalizer = n_tokens if hp.loss_aggregation == "token" else float((mask.sum(1) > 0).sum())
        if world > 1:
            normalizer = float(self.trainer.strategy.reduce(torch.tensor(normalizer, device=device),
                                                            reduce_op="sum")) / world
        ref_lp = None
        mb = hp.micro_batch_size or len(rows)
        chunks = [slice(s, min(s + mb, len(rows))) for s in range(0, len(rows), mb)]
        if self.ref_model is not None:
            was_training = self.ref_model.training
            self.ref_model.eval()
            with torch.no_grad():
                ref_lp = torch.cat([completion_logprobs(self.ref_model, ids[c], targets[c], hp.temperature)[0]
                                    for c in chunks])
            self.ref_model.train(was_training)
        opt = self.optimizers()
        sched = self.lr_schedulers()
        old_lp: list[torch.Tensor] = []
        sums: dict[str, float] = defaultdict(float)
        trainable = [p for p in self.parameters() if p.requires_grad]
        for epoch in range(hp.ppo_epochs):
            opt.zero_grad()
            for k, c in enumerate(chunks):
                logp, entropy, aux = completion_logprobs(self.model, ids[c], targets[c], hp.temperature)
                if epoch == 0:
                    old_lp.append(logp.detach())
                m = mask[c]
                tok_loss, clipped, kl = token_losses(logp, old_lp[k], adv[c], None if ref_lp is None else ref_lp[c],
                                                     hp.kl_coef, hp.clip_eps, hp.clip_eps_high)
                loss = aggregate_loss(tok_loss, m, hp.loss_aggregation, normalizer)
                share = float(m.sum()) / max(n_tokens, 1.0)
                total = loss + hp.aux_loss_weight * aux * share
                self.manual_backward(total)
                mf = m.float()
                sums["loss"] += float(loss.detach())
                sums["aux_loss"] += float(aux.detach()) * share
                if epoch == 0:
                    sums["kl"] += float((kl.detach() * mf).sum())
                    sums["entropy"] += float((entropy * mf).sum())
                    for j in range(logp.shape[0]):  # trainer vs sampler mean log-prob per sequence
                        if bool(m[j].any()):
                            sampler = rollouts.sampler_logprobs[rows[c.start + j]]
                            trainer_mean = float(logp[j, m[j]].detach().mean())
                            sums["logprob_gap"] += abs(trainer_mean - sum(sampler) / max(1, len(sampler)))
                sums[f"clip_frac_{epoch}"] += float((clipped.float() * mf).sum())
            grads = [p.grad for p in trainable if p.grad is not None]
            grad_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(gr) for gr in grads])))\
                if grads else 0.0
            if hp.grad_clip > 0:
                self.clip_gradients(opt, gradient_clip_val=hp.grad_clip, gradient_clip_algorithm="norm")
            opt.step()
            if sched is not None:
                sched.step()
            if hp.balance_bias_update:
                for moe in self.model.moe_layers():
                    if any(p.requires_grad for p in moe.parameters()):
                        moe.update_balance_bias()
            stats["grad_norm"] = grad_norm
        denom = max(n_tokens, 1.0)
        n_seq = sum(1 for j in range(mask.shape[0]) if bool(mask[j].any()))
        stats.update({
            "loss": sums["loss"] / hp.ppo_epochs,
            "aux_loss": sums["aux_loss"] / hp.ppo_epochs,
            "kl": sums["kl"] / denom,
            "entropy": sums["entropy"] / denom,
            "logprob_gap": sums["logprob_gap"] / max(1, n_seq),
            "clip_frac": sum(sums[f"clip_frac_{e}"] for e in range(hp.ppo_epochs)) / (denom * hp.ppo_epochs),
            "update_tokens": n_tokens,
        })
        return stats

    # --- the Lightning step ----------------------------------------------------------------------------------------
    def training_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        hp = self.hparams
        tasks = [record_task(r) for r in batch]
        # sampling seed from (seed, epoch, batch, rank): reproducible, distinct per step and rank, same after resuming
        seed = ((hp.sampling_seed * 1009 + self.current_epoch) * 1_000_003 + batch_idx) * 101 + self.global_rank
        generator = torch.Generator(device=self.model.embed.weight.device).manual_seed(seed)
        self._rollout_steps += 1

        t0 = time.perf_counter()
        rollouts = self.rollout(tasks, generator)
        t1 = time.perf_counter()
        verdicts = self.score(rollouts)
        t2 = time.perf_counter()
        rewards = self.rewards(rollouts, verdicts)
        advantages, keep = compute_advantages(rewards, hp.advantage, hp.std_eps)
        self._groups_seen += len(tasks)
        self._groups_skipped += int((~keep).sum())
        stats = self.update(rollouts, advantages, keep)
        t3 = time.perf_counter()

        self._log_step(rollouts, verdicts, rewards, advantages, keep, stats, (t1 - t0, t2 - t1, t3 - t2))
        self._write_rollouts(rollouts, verdicts, rewards, advantages)

    # --- logging ---------------------------------------------------------------------------------------------------
    def _log_step(self, rollouts: Rollouts, verdicts: Sequence[Any], rewards: torch.Tensor, advantages: torch.Tensor,
                  keep: torch.Tensor, stats: dict[str, float], times: tuple[float, float, float]) -> None:
        n = len(rollouts.texts)
        flat = rewards.flatten()
        scored = flat[~torch.isnan(flat)]
        passed = [v is not None and v.status == "passed" for v in verdicts]
        statuses = Counter("unscorable" if v is None else v.status for v in verdicts)
        logs: dict[str, float] = {
            "train/reward_mean": float(scored.mean()) if scored.numel() else float("nan"),
            "train/reward_std": float(scored.std()) if scored.numel() > 1 else 0.0,
            "train/pass_rate": sum(passed) / n,
            "train/frac_reward_zero_std": float((~keep).float().mean()),
            "train/groups_skipped": float(self._groups_skipped),
            "train/groups_updated": float(self._groups_seen - self._groups_skipped),
            "train/completion_len": sum(len(c) for c in rollouts.completion_ids) / n,
            "train/truncated_frac": sum(rollouts.truncated) / n,
            "train/verifier_failures": float(self._verifier_failures),
            "time/generate_s": times[0],
            "time/verify_s": times[1],
            "time/update_s": times[2],
        }
        for status in ("passed", "failed", "invalid", "timeout", "error", "unscorable"):
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
        for key in ("loss", "aux_loss", "kl", "entropy", "clip_frac", "logprob_gap", "grad_norm"):
            if key in stats:
                logs[f"train/{key}"] = stats[key]
        opt = self.optimizers()
        logs["train/lr"] = float(opt.param_groups[0]["lr"])
        self.log_dict(logs, batch_size=len(rollouts.tasks))
        self.log("train/reward", logs["train/reward_mean"], prog_bar=True, batch_size=len(rollouts.tasks),
                 logger=False)
        every = self.hparams.log_samples_every_n_steps
        if every and (self._rollout_steps - 1) % every == 0:
            self._log_table(rollouts, verdicts, flat, advantages.flatten())

    def _writer(self) -> Any:
        logger = self.logger
        if logger is None or isinstance(logger, DummyLogger):
            return None
        writer = getattr(logger, "experiment", None)
        return writer if hasattr(writer, "add_text") else None

    def _log_table(self, rollouts: Rollouts, verdicts: Sequence[Any], rewards: torch.Tensor,
                   advantages: torch.Tensor) -> None:
        writer = self._writer()
        if writer is None:
            return
        rows = ["| task | reward | adv | verdict | completion |", "|---|---|---|---|---|"]
        for i in range(min(self.hparams.samples_in_log, len(rollouts.texts))):
            v = verdicts[i]
            verdict = "unscorable" if v is None else f"{v.status} ({v.passed_cases}/{v.total_cases})"
            code = rollouts.texts[i].strip().replace("|", "\\|").replace("\n", " ⏎ ")
            rows.append(f"| `{rollouts.task_of(i).entry_point}` | {float(rewards[i]):.2f} | "
                        f"{float(advantages[i]):+.2f} | {verdict} | `{code}` |")
        writer.add_text("samples/rollouts", "\n".join(rows), self.global_step)

    def _log_dir(self) -> Path | None:
        logger = self.logger
        if self._trainer is None or logger is None or isinstance(logger, DummyLogger):
            return None
        log_dir = self.trainer.log_dir
        return Path(log_dir) if log_dir else None

    def _write_rollouts(self, rollouts: Rollouts, verdicts: Sequence[Any], rewards: torch.Tensor,
                        advantages: torch.Tensor) -> None:
        if not self.hparams.rollout_log:
            return
        log_dir = self._log_dir()
        if log_dir is None:
            return
        log_dir.mkdir(parents=True, exist_ok=True)
        name = "rollouts.jsonl" if self.global_rank == 0 else f"rollouts_rank{self.global_rank}.jsonl"
        flat_r, flat_a = rewards.flatten().tolist(), advantages.flatten().tolist()
        with open(log_dir / name, "a", encoding="utf-8") as fh:
            for i, text in enumerate(rollouts.texts):
                task, v = rollouts.task_of(i), verdicts[i]
                fh.write(json.dumps({
                    "step": self.global_step, "rollout_step": self._rollout_steps - 1, "task_id": task.task_id,
                    "family": task.family, "entry_point": task.entry_point, "sample": i % rollouts.group_size,
                    "completion": text, "reward": None if math.isnan(flat_r[i]) else flat_r[i],
                    "advantage": flat_a[i], "truncated": rollouts.truncated[i],
                    "length": len(rollouts.completion_ids[i]),
                    "status": "unscorable" if v is None else v.status,
                    "passed_cases": None if v is None else v.passed_cases,
                    "total_cases": None if v is None else v.total_cases,
                    "detail": "" if v is None else v.detail[:200],
                }) + "\n")

    # --- validation: reference-solution NLL --------------------------------------------------------------------------
    def validation_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        tasks = [record_task(r) for r in batch]
        prompts = [TOK.encode(t.prompt, bos=True) for t in tasks]
        comps = [TOK.encode(t.completion, eos=True) for t in tasks]
        ids, targets, mask = build_sequences(prompts, comps)
        device = self.model.embed.weight.device
        logp, _, _ = completion_logprobs(self.model, ids.to(device), targets.to(device))
        mask = mask.to(device)
        nll = -(logp * mask).sum(1) / mask.sum(1)
        self.log("val/ref_nll", nll.mean(), batch_size=len(tasks))
        by_family: dict[str, list[int]] = defaultdict(list)
        for i, t in enumerate(tasks):
            by_family[t.family].append(i)
        for fam, idx in by_family.items():
            self.log(f"val/ref_nll/{fam}", nll[idx].mean(), batch_size=len(idx))
