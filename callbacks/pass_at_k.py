"""PassAtKCallback: sampled pass@k and greedy pass rate on a task split, overall and per family.

At the end of every (non-sanity) validation epoch the callback generates, for each evaluation task, `n` samples at
`temperature` plus one greedy completion, scores them in the sandboxed verifier and logs

    {prefix}/pass@{k}            for every k in `ks` (unbiased estimator, glm_lightning.metrics.pass_at_k)
    {prefix}/greedy_pass         fraction of tasks whose greedy completion passes
    {prefix}/sampled_exact       passing samples (a count) out of {prefix}/sampled_total = tasks x n
    {prefix}/.../{family}        the same per family, and per role (`rewarded` / `monitor`) when the datamodule
                                 says which families RL trains on

With `evaluate_at_start: true` the same evaluation also runs once before the first training step; its values are
logged under the same tags at that step (the first point of the curve) and under `start/{tag}` (the "before" value
of a before -> after comparison, which a later point cannot overwrite). With `start_cache: <dir>` that evaluation is
read from a cache entry when one exists for exactly these starting weights, tasks, settings and code
(`glm_lightning.eval_cache`): the arms of a sweep that share a start and a seed measure their "before" once.

Tasks come from the datamodule's `eval_tasks(split, per_family, families)` (RLPromptDataModule) unless `families`
and `per_family` are given here. Under DDP every rank evaluates its share of the tasks (r, r+W, ...); the
`PassAtK` metrics sum exactly across ranks.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.utilities import rank_zero_info

from glm_lightning import eval_cache
from glm_lightning.evaluation import (
    TaskOutcomes,
    VerifierSettings,
    close_own_verifier,
    evaluate_tasks,
    family_roles,
    module_verifier,
    resolve_eval_tasks,
    shard,
)
from glm_lightning.generation import check_precision
from glm_lightning.metrics import PassAtK
from glm_lightning.tasks.families import resolve_families
from glm_lightning.tasks.task import SPLITS


class PassAtKCallback(Callback):
    """Logs pass@k (n samples per task) and greedy pass on an evaluation split; see the module docstring."""

    def __init__(
        self,
        split: str | None = None,
        n: int = 8,
        ks: list[int] = [1, 8],  # noqa: B006 - jsonargparse needs a literal default
        temperature: float = 0.35,
        top_p: float | None = None,
        max_new_tokens: int = 48,
        greedy: bool = True,
        families: list[str] | None = None,
        per_family: int | None = None,
        seed: int = 0,
        every_n_evals: int = 1,
        prefix: str = "val",
        verifier_workers: int = 2,
        verifier_timeout_s: float = 2.0,
        evaluate_at_start: bool = False,
        precision: str = "32",
        start_cache: str | None = None,
    ) -> None:
        """
        Args:
            split: task split (`dev`, `confirm`, ...); None = the datamodule's eval split.
            n: samples per task (>= max(ks)); 0 = greedy only.
            ks: the k of every logged pass@k.
            temperature, top_p: sampling settings of the n samples.
            max_new_tokens: completion budget.
            greedy: also decode greedily and log `greedy_pass`.
            families, per_family: explicit evaluation set (default: the datamodule's).
            seed: sampling seed (the same samples are drawn at every evaluation of an unchanged model).
            every_n_evals: evaluate on every n-th validation epoch.
            prefix: metric name prefix.
            verifier_workers, verifier_timeout_s: only used when the module has no verifier of its own.
            evaluate_at_start: also evaluate before training (logged as `start/{tag}` and as the curve's first point).
            precision: weights the evaluation samples from: `32` (the model's) or `bf16` (a bf16 copy of its
                matrices; README, "Precision").
            start_cache: a directory of cached start evaluations (None = always evaluate); see the module docstring.
        """
        super().__init__()
        ks = sorted({int(k) for k in ks})
        if not ks or ks[0] < 1:
            raise ValueError(f"ks must be positive ints, got {ks}")
        if n and n < ks[-1]:
            raise ValueError(f"n = {n} samples per task cannot estimate pass@{ks[-1]}: need n >= max(ks)")
        if n < 0 or (n == 0 and not greedy):
            raise ValueError("n must be >= 0, and n = 0 needs greedy = true (nothing to evaluate otherwise)")
        if split is not None and split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid splits: {SPLITS}")
        if every_n_evals < 1 or max_new_tokens < 1 or temperature <= 0:
            raise ValueError("need every_n_evals >= 1, max_new_tokens >= 1, temperature > 0")
        self.families = list(resolve_families(families)) if families is not None else None
        self.split, self.n, self.ks = split, n, ks
        self.temperature, self.top_p, self.max_new_tokens = temperature, top_p, max_new_tokens
        self.greedy, self.per_family, self.seed = greedy, per_family, seed
        self.every_n_evals, self.prefix, self.evaluate_at_start = every_n_evals, prefix, evaluate_at_start
        self.precision = check_precision(precision)
        self.start_cache = start_cache
        self.start_cached_at: str | None = None  # the entry the start evaluation was read from, if it was
        self.verifier_settings = VerifierSettings(workers=verifier_workers, timeout_s=verifier_timeout_s)
        self._evals = 0
        self._own: dict[str, Any] = {}
        self.last_results: dict[str, float] = {}
        self.last_outcomes: TaskOutcomes | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.evaluate_at_start:
            return
        results = self.evaluate_start(trainer, pl_module)
        logger = trainer.logger
        if logger is not None and not isinstance(logger, DummyLogger) and trainer.is_global_zero:
            logger.log_metrics({**results, **{f"start/{k}": v for k, v in results.items()}}, step=trainer.global_step)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self._evals += 1
        if (self._evals - 1) % self.every_n_evals:
            return
        results = self.evaluate(trainer, pl_module)
        for name, value in results.items():
            pl_module.log(name, value, prog_bar=name in (f"{self.prefix}/pass@1", f"{self.prefix}/greedy_pass"))

    def evaluate_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        """The evaluation before training: from `start_cache` when an entry for exactly these weights, tasks, settings
        and code exists, else evaluated (and stored). Rank 0 decides and broadcasts, so all ranks agree."""
        if not self.start_cache:
            return self.evaluate(trainer, pl_module)
        tasks = resolve_eval_tasks(trainer, self.split, self.per_family, self.families, self.seed)
        settings = {"measurement": "PassAtKCallback start", "tasks": eval_cache.task_identities(tasks),
                    "roles": family_roles(trainer), "n": self.n, "ks": self.ks, "greedy": self.greedy,
                    "temperature": self.temperature, "top_p": self.top_p, "max_new_tokens": self.max_new_tokens,
                    "seed": self.seed, "precision": self.precision, "prefix": self.prefix,
                    "world_size": trainer.world_size, "verifier_timeout_s": self.verifier_settings.timeout_s}
        results, entry = eval_cache.cached_or_computed(trainer, self.start_cache, pl_module.model, settings,
                                                       lambda: self.evaluate(trainer, pl_module))
        if entry is not None:
            self.start_cached_at = str(entry)
            self.last_results, self.last_outcomes = dict(results), None
            rank_zero_info(f"[pass@k] start evaluation reused from {entry}")
        return dict(results)

    def evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        """Run the evaluation now and return the (rank-synchronised) metric values."""
        tasks = resolve_eval_tasks(trainer, self.split, self.per_family, self.families, self.seed)
        local = shard(tasks, trainer)
        verifier = module_verifier(pl_module, self._own, self.verifier_settings)
        outcomes = evaluate_tasks(pl_module.model, local, verifier, n_samples=self.n, greedy=self.greedy,
                                  temperature=self.temperature, top_p=self.top_p,
                                  max_new_tokens=self.max_new_tokens, seed=self.seed, precision=self.precision)
        self.last_outcomes = outcomes
        roles = family_roles(trainer)
        groups = sorted({t.family for t in tasks}) + sorted(set(roles.values()))
        device = pl_module.device
        sampled = {g: PassAtK(self.ks).to(device) for g in ["all", *groups]} if self.n else {}
        greedy = {g: PassAtK((1,)).to(device) for g in ["all", *groups]} if self.greedy else {}
        members: dict[str, list[int]] = defaultdict(list)
        for i, t in enumerate(local):
            for g in ("all", t.family, roles.get(t.family)):
                if g is not None:
                    members[g].append(i)
        for g in sampled:
            idx = members.get(g, [])
            sampled[g].update([self.n] * len(idx), [outcomes.correct[i] for i in idx])
        for g in greedy:
            idx = members.get(g, [])
            greedy[g].update([1] * len(idx), [int(outcomes.greedy[i]) for i in idx])
        results: dict[str, float] = {}
        for g, metric in sampled.items():  # every rank computes every group (collective sync inside compute)
            suffix = "" if g == "all" else f"/{g}"
            for name, value in metric.compute().items():
                if not math.isnan(float(value)):
                    results[f"{self.prefix}/{name}{suffix}"] = float(value)
        for g, metric in greedy.items():
            suffix = "" if g == "all" else f"/{g}"
            value = float(metric.compute()["pass@1"])
            if not math.isnan(value):
                results[f"{self.prefix}/greedy_pass{suffix}"] = value
        if self.n and f"{self.prefix}/pass@1" in results:  # pass@1 is the exact mean of c/n: recover the count
            total = len(tasks) * self.n
            results[f"{self.prefix}/sampled_total"] = float(total)
            results[f"{self.prefix}/sampled_exact"] = float(round(results[f"{self.prefix}/pass@1"] * total))
        self.last_results = results
        return results

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        close_own_verifier(self._own)
