"""RLModule: group-relative policy-gradient post-training (RLOO / GRPO / Dr. GRPO) on executable function tasks.

One training step (manual optimization): **rollout** G completions per prompt with the cached generator,
**score** them in the sandboxed verifier (model-written code never runs in this process; a verifier breakdown makes
the step's samples unscorable instead of stopping the run), turn verdicts into **rewards** and group-relative
**advantages**, then **update**: reference log-probs (when `kl_coef > 0`), `ppo_epochs` policy steps on the
informative groups, and the step statistics. The maths lives in `glm_lightning.rl.loss`, the settings in
`glm_lightning.rl.config`, the rollout logs in `glm_lightning.rl.rollouts`; every option and log is described once,
in `docs/rl.md`.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from glm_lightning.evaluation import VerifierSettings, completion_finished, verifier_jobs
from glm_lightning.generation import generate, weights_changed
from glm_lightning.modules.base import StageModule
from glm_lightning.modules.rl_budget import Budget, BudgetCounter
from glm_lightning.rl.batch import UpdateBatch
from glm_lightning.rl.config import PolicyLoss, Reward, Sampling
from glm_lightning.rl.loss import (
    aggregate_loss,
    build_sequences,
    completion_logprobs,
    compute_advantages,
    pad_completions,
    token_losses,
    verdict_reward,
)
from glm_lightning.rl.rollouts import Rollouts, append_rollouts, rollout_table, step_metrics
from glm_lightning.tasks.task import Task, record_task
from glm_lightning.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


class RLModule(StageModule):
    """RL post-training stage (algorithm above; options and logs in docs/rl.md)."""

    def __init__(
        self,
        sampling: Sampling = Sampling(),  # noqa: B008 - frozen dataclass; jsonargparse reads its fields as defaults
        reward: Reward = Reward(),  # noqa: B008
        loss: PolicyLoss = PolicyLoss(),  # noqa: B008
        verifier: VerifierSettings = VerifierSettings(),  # noqa: B008
        budget: Budget = Budget(),  # noqa: B008
        grad_clip: float = 1.0,
        micro_batch_size: int | None = None,
        untie_head: bool = True,
        log_samples_every_n_steps: int = 10,
        **kwargs: Any,
    ) -> None:
        """
        Args:
            sampling: how rollouts are drawn (group size, temperature, top-p, completion budget, seed).
            reward: how a verdict becomes a reward (binary / partial, invalid penalty, format bonus).
            loss: advantage estimator, loss aggregation, KL to the start policy, PPO clip and epochs.
            verifier: sandboxed verifier settings.
            budget: completions or prompts drawn before the run stops (null: `trainer.max_steps` optimizer steps).
            grad_clip: max global grad norm (0 = off).
            micro_batch_size: rows per forward/backward, rounded down to whole groups of G (null = the whole step
                at once).
            untie_head: give the output head its own weights (it trains while the input embedding stays frozen).
            log_samples_every_n_steps: period of the rollout text table (0 = never).
            **kwargs: the shared stage arguments (`StageModule`: preset, model_overrides, init_weights, lr, ...);
                RL configs usually want a small constant lr (`min_lr_ratio: 1`, no warm-up, no weight decay).
        """
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError("micro_batch_size must be >= 1 or null")
        if grad_clip < 0:
            raise ValueError("grad_clip must be >= 0")
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.sampling, self.reward, self.loss, self.verifier_settings = sampling, reward, loss, verifier
        if untie_head:
            self.model.untie_head()
        self.ref_model: torch.nn.Module | None = None
        if loss.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).requires_grad_(False)
        self._rollout_steps = self._groups_skipped = self._groups_seen = self._verifier_failures = 0
        self._fit_t0: float | None = None
        self.budget = BudgetCounter(budget)

    # --- the run's wall time ---------------------------------------------------------------------------------------
    def on_fit_start(self) -> None:
        self._fit_t0 = time.perf_counter()
        if self._trainer is not None:
            self.budget.check_trainer(self.trainer.max_steps, self.trainer.fast_dev_run)
        summary = getattr(self.verifier, "summary", None)  # started now: the log says at once what isolates rewards
        if callable(summary):
            rank_zero_info(summary())

    def on_train_end(self) -> None:
        """Print and log (`time/run_s`) the run's wall time so far: start-of-training evaluations, training and the
        callbacks' end-of-training evaluations (their `on_train_end` runs before the module's)."""
        if self._fit_t0 is None:
            return
        wall = time.perf_counter() - self._fit_t0
        if self.trainer.is_global_zero:
            print(f"RL run wall time: {wall:.1f} s ({wall / 60:.1f} min), {self.budget.summary(self.global_step)}, "
                  f"{self._groups_seen - self._groups_skipped}/{self._groups_seen} groups updated", flush=True)
            if self.logger is not None and not isinstance(self.logger, DummyLogger):
                self.logger.log_metrics({"time/run_s": wall}, step=self.global_step)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["rl_budget"] = {"prompts": self.budget.prompts, "completions": self.budget.completions}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A resumed run goes on counting its budget from where it stopped."""
        counts = checkpoint.get("rl_budget", {})
        self.budget.prompts, self.budget.completions = counts.get("prompts", 0), counts.get("completions", 0)

    # --- step 1: rollouts ------------------------------------------------------------------------------------------
    def rollout(self, tasks: Sequence[Task], generator: torch.Generator | None = None) -> Rollouts:
        """Sample G completions per task with the cached generator (no gradient)."""
        s = self.sampling
        prompt_ids = [TOK.encode(t.prompt, bos=True) for t in tasks]
        ids, valid = TOK.left_pad(prompt_ids)
        limit = min(s.max_new_tokens, self.model.cfg.max_seq_len - ids.shape[1])
        if limit < 1:
            raise ValueError(f"prompt of {ids.shape[1]} tokens leaves no room in the model context "
                             f"({self.model.cfg.max_seq_len})")
        device = self.model.embed.weight.device
        gen = generate(self.model, ids.to(device), max_new_tokens=limit, temperature=s.temperature, top_p=s.top_p,
                       num_samples=s.group_size, attention_mask=valid.to(device), generator=generator,
                       stop_fn=completion_finished, precision=s.precision)
        tokens, lengths, lps = gen.tokens.cpu(), gen.lengths.cpu(), gen.logprobs.cpu()
        comp = [tokens[row, : int(lengths[row])].tolist() for row in range(tokens.shape[0])]
        return Rollouts(list(tasks), prompt_ids, comp, [TOK.decode(c) for c in comp],
                        [lps[row, : len(c)].tolist() for row, c in enumerate(comp)],
                        [not ((c and c[-1] == TOK.eos_id) or completion_finished(c)) for c in comp], s.group_size)

    # --- step 2: scoring -------------------------------------------------------------------------------------------
    def score(self, rollouts: Rollouts) -> list[Any]:
        """Verdicts (one per sample) from the sandboxed verifier; None for every sample if the verifier itself
        failed (infrastructure error: the samples are unscorable and the verifier is restarted)."""
        jobs = verifier_jobs([rollouts.task_of(i) for i in range(len(rollouts.texts))], rollouts.texts)
        try:
            return list(self.verifier.check_many(jobs))
        except Exception as exc:  # noqa: BLE001 - any sandbox breakage must not stop training
            self._verifier_failures += len(jobs)
            rank_zero_warn(f"verifier failed on a batch of {len(jobs)} samples ({type(exc).__name__}: {exc}); "
                           "they are treated as unscorable and the verifier is restarted")
            self.close_verifier()
            return [None] * len(jobs)

    def rewards(self, rollouts: Rollouts, verdicts: Sequence[Any]) -> torch.Tensor:
        r = self.reward
        values = [verdict_reward(v, r.kind, r.invalid_penalty, r.format_bonus, t)
                  for v, t in zip(verdicts, rollouts.truncated)]
        return torch.tensor(values, dtype=torch.float32).view(-1, rollouts.group_size)

    # --- step 3: update --------------------------------------------------------------------------------------------
    def update_batch(self, rollouts: Rollouts, advantages: torch.Tensor, keep: torch.Tensor) -> UpdateBatch | None:
        """The informative groups (None when no rank has any). Under DDP a rank without any joins the backward with
        one zero-weight group, and the loss normaliser is the mean over ranks. Micro-batches hold whole groups:
        `micro_batch_size` rows, rounded down to a multiple of G (at least one group)."""
        g = rollouts.group_size
        groups = [i for i in range(len(rollouts.tasks)) if bool(keep[i])]
        world = self.trainer.world_size if self._trainer is not None else 1
        any_rows = self.trainer.strategy.reduce_boolean_decision(bool(groups), all=False) if world > 1 \
            else bool(groups)
        if not any_rows:
            return None
        weight = 1.0 if groups else 0.0
        groups = groups or [0]
        rows = [i * g + j for i in groups for j in range(g)]
        prompt_ids, prompt_valid = TOK.left_pad([rollouts.prompt_ids[i] for i in groups])
        completions, mask = pad_completions([rollouts.completion_ids[i] or [TOK.pad_id] for i in rows])
        mask &= torch.tensor([bool(rollouts.completion_ids[i]) for i in rows])[:, None]
        device = self.model.embed.weight.device
        mask = (mask & (weight > 0)).to(device)
        normalizer = float(mask.sum()) if self.loss.aggregation == "token" else float((mask.sum(1) > 0).sum())
        if world > 1:
            normalizer = float(self.trainer.strategy.reduce(torch.tensor(normalizer, device=device),
                                                            reduce_op="sum")) / world
        per = max(1, (self.hparams.micro_batch_size or len(rows)) // g)  # groups per micro-batch
        chunks = [(slice(s, min(s + per, len(groups))), slice(s * g, min(s + per, len(groups)) * g))
                  for s in range(0, len(groups), per)]
        return UpdateBatch(rows, prompt_ids.to(device), prompt_valid.to(device), completions.to(device), mask,
                           advantages.flatten()[rows].to(device), normalizer, chunks)

    @torch.no_grad()
    def reference_logprobs(self, batch: UpdateBatch) -> torch.Tensor | None:
        """Log-probs of the completions under the frozen starting policy (None without KL)."""
        if self.ref_model is None:
            return None
        was_training = self.ref_model.training
        self.ref_model.eval()
        t = self.loss.trained_temperature(self.sampling.temperature)
        out = torch.cat([batch.logprobs(self.ref_model, c, t)[0] for c in batch.chunks])
        self.ref_model.train(was_training)
        return out

    def policy_step(self, batch: UpdateBatch, old_lp: list[torch.Tensor], ref_lp: torch.Tensor | None,
                    rollouts: Rollouts, sums: dict[str, float]) -> float:
        """One optimizer step over all micro-batches; fills `old_lp` on the first epoch and accumulates the step
        statistics into `sums`. Returns the gradient norm before clipping."""
        lc, first = self.loss, not old_lp
        opt = self.optimizers()
        opt.zero_grad()
        temperature = self.loss.trained_temperature(self.sampling.temperature)
        for k, c in enumerate(batch.chunks):
            logp, entropy, aux = batch.logprobs(self.model, c, temperature)
            if first:
                old_lp.append(logp.detach())
            rows = c[1]
            m = batch.mask[rows]
            tok_loss, clipped, kl = token_losses(logp, old_lp[k], batch.advantages[rows],
                                                 None if ref_lp is None else ref_lp[rows], lc.kl_coef, lc.clip_eps,
                                                 lc.clip_eps_high)
            loss = aggregate_loss(tok_loss, m, lc.aggregation, batch.normalizer)
            share = float(m.sum()) / max(batch.n_tokens, 1.0)
            with torch.autocast(self.device.type, enabled=False):  # as automatic optimization runs it: outside
                self.manual_backward(loss + aux * share)  # the autocast of training_step (bf16-mixed)
            mf = m.float()
            sums["loss"] += float(loss.detach())
            sums["aux_loss"] += float(aux.detach()) * share
            sums["clipped"] += float((clipped.float() * mf).sum())
            if first:
                sums["kl"] += float((kl.detach() * mf).sum())
                sums["entropy"] += float((entropy * mf).sum())
                sums["logprob_gap"] += self._logprob_gap(logp.detach(), m, batch.rows[rows], rollouts)
        grads = [p.grad for p in self.parameters() if p.requires_grad and p.grad is not None]
        grad_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) \
            if grads else 0.0
        if self.hparams.grad_clip > 0:
            self.clip_gradients(opt, gradient_clip_val=self.hparams.grad_clip, gradient_clip_algorithm="norm")
        opt.step()
        if self.sampling.precision != "32":  # any optimizer: the next rollouts must sample from the updated policy
            weights_changed(self.model)
        sched = self.lr_schedulers()
        if sched is not None:
            sched.step()
        return grad_norm

    @staticmethod
    def _logprob_gap(logp: torch.Tensor, mask: torch.Tensor, rows: list[int], rollouts: Rollouts) -> float:
        """Sum over sequences of |trainer mean log-prob - sampler mean log-prob| (a numerics check)."""
        gap = 0.0
        for j, row in enumerate(rows):
            if bool(mask[j].any()):
                sampler = rollouts.sampler_logprobs[row]
                gap += abs(float(logp[j, mask[j]].mean()) - sum(sampler) / max(1, len(sampler)))
        return gap

    def update(self, rollouts: Rollouts, advantages: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
        """Reference log-probs, `ppo_epochs` policy steps on the informative groups, and the step statistics."""
        batch = self.update_batch(rollouts, advantages, keep)
        if batch is None:
            return {}
        t0 = time.perf_counter()
        ref_lp = self.reference_logprobs(batch)
        t1 = time.perf_counter()
        old_lp: list[torch.Tensor] = []
        sums: dict[str, float] = defaultdict(float)
        epochs = self.loss.ppo_epochs
        grad_norm = 0.0
        for _ in range(epochs):
            grad_norm = self.policy_step(batch, old_lp, ref_lp, rollouts, sums)
        denom = max(batch.n_tokens, 1.0)
        n_seq = int((batch.mask.sum(1) > 0).sum())
        return {"loss": sums["loss"] / epochs, "aux_loss": sums["aux_loss"] / epochs, "kl": sums["kl"] / denom,
                "entropy": sums["entropy"] / denom, "logprob_gap": sums["logprob_gap"] / max(1, n_seq),
                "clip_frac": sums["clipped"] / (denom * epochs), "grad_norm": grad_norm,
                "time/ref_logprobs_s": t1 - t0, "time/policy_s": time.perf_counter() - t1}

    # --- the Lightning step ----------------------------------------------------------------------------------------
    def training_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        tasks = [record_task(r) for r in batch]
        # sampling seed from (seed, epoch, batch, rank): reproducible, distinct per step and rank, same after resuming
        seed = ((self.sampling.seed * 1009 + self.current_epoch) * 1_000_003 + batch_idx) * 101 + self.global_rank
        generator = torch.Generator(device=self.model.embed.weight.device).manual_seed(seed)
        self._rollout_steps += 1
        t0 = time.perf_counter()
        rollouts = self.rollout(tasks, generator)
        t1 = time.perf_counter()
        verdicts = self.score(rollouts)
        t2 = time.perf_counter()
        rewards = self.rewards(rollouts, verdicts)
        advantages, keep = compute_advantages(rewards, self.loss.advantage, self.loss.std_eps)
        self._groups_seen += len(tasks)
        self._groups_skipped += int((~keep).sum())
        stats = self.update(rollouts, advantages, keep)
        t3 = time.perf_counter()
        self.budget.count(len(tasks) * (self.trainer.world_size if self._trainer is not None else 1),
                          self.sampling.group_size)  # every group drawn, skipped or not
        self._log_step(rollouts, verdicts, rewards, advantages, keep, stats, (t1 - t0, t2 - t1, t3 - t2))
        if self._trainer is not None:
            self.budget.end_of_batch(self.trainer, self.global_step)

    def _log_step(self, rollouts: Rollouts, verdicts: Sequence[Any], rewards: torch.Tensor, advantages: torch.Tensor,
                  keep: torch.Tensor, stats: dict[str, float], times: tuple[float, float, float]) -> None:
        logs = step_metrics(rollouts, verdicts, rewards, keep)
        logs.update({k if k.startswith("time/") else f"train/{k}": v for k, v in stats.items()})
        logs.update({"train/groups_skipped": float(self._groups_skipped),
                     "train/groups_updated": float(self._groups_seen - self._groups_skipped),
                     "train/verifier_failures": float(self._verifier_failures),
                     "train/lr": float(self.optimizers().param_groups[0]["lr"]), **self.budget.logs(self.global_step),
                     "time/generate_s": times[0], "time/verify_s": times[1], "time/update_s": times[2]})
        n_prompts = len(rollouts.tasks)
        self.log_dict(logs, batch_size=n_prompts)
        self.log("train/reward", logs["train/reward_mean"], prog_bar=True, batch_size=n_prompts, logger=False)
        log_dir = self._log_dir()
        if log_dir is None:
            return
        every = self.hparams.log_samples_every_n_steps
        writer = getattr(self.logger, "experiment", None)
        if every and (self._rollout_steps - 1) % every == 0 and hasattr(writer, "add_text"):
            writer.add_text("samples/rollouts", rollout_table(rollouts, verdicts, rewards, advantages),
                            self.global_step)
        name = "rollouts.jsonl" if self.global_rank == 0 else f"rollouts_rank{self.global_rank}.jsonl"
        append_rollouts(log_dir / name, self.global_step, self._rollout_steps - 1, rollouts, verdicts, rewards,
                        advantages)

    def _log_dir(self) -> Path | None:
        if self._trainer is None or self.logger is None or isinstance(self.logger, DummyLogger):
            return None
        return Path(self.trainer.log_dir) if self.trainer.log_dir else None

    # --- validation: reference-solution NLL ------------------------------------------------------------------------
    def validation_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        tasks = [record_task(r) for r in batch]
        ids, targets, mask = build_sequences([TOK.encode(t.prompt, bos=True) for t in tasks],
                                             [TOK.encode(t.completion, eos=True) for t in tasks])
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
