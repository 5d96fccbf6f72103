"""RegressionCallback: per-family before/after comparison with paired tests, to catch interference during RL.

- **Baseline** (`on_train_start`, i.e. the starting checkpoint after any freezing/untying): every family of the
  evaluation set is measured: greedy pass/fail per task, plus `n_samples` sampled completions per task if asked.
- **At every evaluation** (`on_validation_epoch_end`, not during the sanity check) the same tasks are measured again
  and compared with the baseline, per family:
    - greedy pass rate before and after, each with a Wilson interval;
    - the change, with a paired percentile-bootstrap interval over tasks (and the same for the sampled pass rate);
    - an exact McNemar test on the paired greedy outcomes (losses b = passed before & fails now, gains c);
    - Holm adjustment of the McNemar p-values across families.
  A family is a **significant regression** when its Holm-adjusted p <= `alpha`, it lost more tasks than it gained,
  and the drop is at least `min_effect` (predeclare it). Flagged families are warned about in the log, logged as
  `{prefix}/flagged` and, with `stop_on_regression: true`, stop training (`trainer.should_stop`).
- **At the end** of training (after a final measurement when the last evaluation is stale) it writes
  `regression_report.json` and `regression_report.md` into the logger's log_dir (or `output_dir`).
  `every_n_evals: 0` compares only there (a large evaluation set measured twice, before and after).

Logged per family: `{prefix}/{family}/delta` (greedy), `{prefix}/{family}/p_holm`, and `{prefix}/flagged`. Per role
(`rewarded`, `monitor`, `all`), at the baseline and at every comparison, the summary rates of the tutorial's
confirmation table (`summary_rates`): `{prefix}/before/<role>/…` and `{prefix}/after/<role>/…`.
Under DDP every rank measures its share of the tasks; per-task outcomes are all-gathered, so all ranks compute
the same report and take the same stop decision. Model-written code only runs inside the sandboxed verifier.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from glm_lightning import eval_cache
from glm_lightning.evaluation import (
    VerifierSettings,
    close_own_verifier,
    evaluate_tasks,
    family_roles,
    gather_sharded,
    module_verifier,
    resolve_eval_tasks,
    shard,
)
from glm_lightning.stats import Measurement, compare_families, format_p
from glm_lightning.tasks.families import resolve_families
from glm_lightning.tasks.task import SPLITS

def summary_counts(measurement: Measurement, roles: dict[str, str], n_samples: int) -> dict[str, dict[str, int]]:
    """Counts of the tutorial's confirmation table per role (`rewarded`, `monitor`, `all`): `tasks`,
    `greedy_pass` (tasks whose greedy completion passes) and, with `n_samples` > 0, `samples`, `sampled_exact`
    (passing samples) and `pass@n` (tasks with at least one passing sample of n). Families without a role count in
    `all` only."""
    out: dict[str, dict[str, int]] = {}
    for fam, m in measurement.items():
        for group in ("all", roles.get(fam)):
            if group is None:
                continue
            c = out.setdefault(group, {"tasks": 0, "greedy_pass": 0})
            c["tasks"] += len(m["greedy"])
            c["greedy_pass"] += int(sum(int(v) for v in m["greedy"]))
            if n_samples and m.get("sampled"):
                exact = [round(float(v) * n_samples) for v in m["sampled"]]
                c["samples"] = c.get("samples", 0) + n_samples * len(exact)
                c["sampled_exact"] = c.get("sampled_exact", 0) + sum(exact)
                c[f"pass@{n_samples}"] = c.get(f"pass@{n_samples}", 0) + sum(e > 0 for e in exact)
    return out


def summary_rates(counts: dict[str, dict[str, int]], prefix: str) -> dict[str, float]:
    """`summary_counts` as rates, keyed `{prefix}/<role>/<measure>`: greedy_pass and pass@n per task,
    sampled_exact per sample."""
    rates: dict[str, float] = {}
    for group, c in counts.items():
        if c["tasks"]:
            rates[f"{prefix}/{group}/greedy_pass"] = c["greedy_pass"] / c["tasks"]
            for key in c:
                if key.startswith("pass@"):
                    rates[f"{prefix}/{group}/{key}"] = c[key] / c["tasks"]
        if c.get("samples"):
            rates[f"{prefix}/{group}/sampled_exact"] = c["sampled_exact"] / c["samples"]
    return rates


def markdown_report(report: dict[str, Any], title: str = "Regression report") -> str:
    """Human-readable table of a `compare_families` report (plus optional run metadata under report["run"])."""
    conf = report.get("confidence", 0.95)
    lines = [f"# {title}", ""]
    run = report.get("run", {})
    if run:
        lines += [", ".join(f"{k}: {v}" for k, v in run.items()), ""]
    lines += [
        f"Paired test: {report['test']}; alpha = {report['alpha']}, minimum effect = {report['min_effect']}.",
        f"Rates are greedy pass rates over the same tasks before/after, with {conf:.0%} Wilson intervals; the change "
        f"has a {conf:.0%} paired bootstrap interval over tasks. Losses = tasks passed before and failed now.",
        "",
        "| family | role | tasks | before | after | change | losses / gains | p (McNemar) | p (Holm) | verdict |",
        "|---|---|---:|---|---|---|---:|---:|---:|---|",
    ]
    for fam, r in report["families"].items():
        def rate(key: str, r: dict[str, Any] = r) -> str:
            lo, hi = r[f"{key}_ci"]
            return f"{r[key]:.2f} [{lo:.2f}, {hi:.2f}]"
        lo, hi = r["delta_ci"]
        change = f"{r['delta']:+.2f} [{lo:+.2f}, {hi:+.2f}]"
        if "delta_sampled" in r:
            slo, shi = r["delta_sampled_ci"]
            change += f"; sampled {r['delta_sampled']:+.2f} [{slo:+.2f}, {shi:+.2f}]"
        verdict = f"**{r['verdict']}**" if r["regression"] else r["verdict"]
        lines.append(f"| {fam} | {r['role']} | {r['n_tasks']} | {rate('baseline_greedy')} | {rate('current_greedy')} "
                     f"| {change} | {r['losses']} / {r['gains']} | {format_p(r['p_mcnemar'])} "
                     f"| {format_p(r['p_holm'])} | {verdict} |")
    lines.append("")
    if report["flagged"]:
        lines.append(f"Significant regressions: {', '.join(report['flagged'])}.")
    else:
        lines.append("No significant regression.")
    if report["improved"]:
        lines.append(f"Significant improvements: {', '.join(report['improved'])}.")
    return "\n".join(lines) + "\n"


class RegressionCallback(Callback):
    """Measures every family before training and at each evaluation; flags Holm-significant regressions."""

    def __init__(
        self,
        families: list[str] | None = None,
        split: str | None = None,
        per_family: int | None = None,
        n_samples: int = 0,
        temperature: float = 0.35,
        max_new_tokens: int = 48,
        alpha: float = 0.05,
        min_effect: float = 0.0,
        confidence: float = 0.95,
        n_boot: int = 10000,
        stop_on_regression: bool = False,
        every_n_evals: int = 1,
        evaluate_at_end: bool = True,
        output_dir: str | None = None,
        seed: int = 0,
        prefix: str = "regression",
        verifier_workers: int = 2,
        verifier_timeout_s: float = 2.0,
        baseline_cache: str | None = None,
    ) -> None:
        """
        Args:
            families: families to watch (default: the datamodule's rewarded + monitor families).
            split: task split (default: the datamodule's eval split).
            per_family: tasks per family (default: the datamodule's eval_per_family).
            n_samples: sampled completions per task in addition to greedy (0 = greedy only).
            temperature, max_new_tokens: decoding settings.
            alpha: family-wise error rate (Holm). min_effect: smallest drop in greedy pass rate to call a regression.
            confidence, n_boot: interval level and bootstrap draws.
            stop_on_regression: stop training at the first evaluation with a significant regression.
            every_n_evals: compare on every n-th validation epoch; 0 = only once, at the end of training.
            evaluate_at_end: measure once more at the end of training if the last comparison is stale.
            output_dir: where to write the reports (default: the logger's log_dir, else the trainer's root dir).
            seed: sampling/bootstrap seed.
            prefix: metric name prefix.
            verifier_workers, verifier_timeout_s: only used when the module has no verifier of its own.
            baseline_cache: a directory of cached baseline measurements (None = always measure). The entry's key
                covers the starting weights, every evaluation setting and the package's code, so the seeds of a
                sweep that start from one checkpoint measure their shared "before" once (`glm_lightning.eval_cache`).
        """
        super().__init__()
        if not 0 < alpha < 1 or not 0 < confidence < 1:
            raise ValueError("alpha and confidence must lie in (0, 1)")
        if min_effect < 0 or n_samples < 0 or every_n_evals < 0 or n_boot < 1 or max_new_tokens < 1:
            raise ValueError("need min_effect >= 0, n_samples >= 0, every_n_evals >= 0, n_boot >= 1, "
                             "max_new_tokens >= 1")
        if every_n_evals == 0 and not evaluate_at_end:
            raise ValueError("every_n_evals = 0 compares only at the end: it needs evaluate_at_end = true")
        if split is not None and split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid splits: {SPLITS}")
        self.families = list(resolve_families(families)) if families is not None else None
        self.split, self.per_family, self.n_samples = split, per_family, n_samples
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.alpha, self.min_effect, self.confidence, self.n_boot = alpha, min_effect, confidence, n_boot
        self.stop_on_regression, self.every_n_evals = stop_on_regression, every_n_evals
        self.evaluate_at_end, self.output_dir, self.seed, self.prefix = evaluate_at_end, output_dir, seed, prefix
        self.verifier_settings = VerifierSettings(workers=verifier_workers, timeout_s=verifier_timeout_s)
        self.baseline_cache = baseline_cache
        self.baseline_cached_at: str | None = None
        self.baseline: Measurement | None = None
        self.baseline_step: int | None = None
        self.last_measurement: Measurement | None = None
        self.history: list[dict[str, Any]] = []
        self.stopped_at: int | None = None
        self._evals = 0
        self._own: dict[str, Any] = {}

    # --- measuring -------------------------------------------------------------------------------------------------
    def measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Measurement:
        """Per-family greedy (and sampled) outcomes of every evaluation task, identical on all ranks."""
        tasks = resolve_eval_tasks(trainer, self.split, self.per_family, self.families, self.seed)
        local = shard(tasks, trainer)
        verifier = module_verifier(pl_module, self._own, self.verifier_settings)
        out = evaluate_tasks(pl_module.model, local, verifier, n_samples=self.n_samples, greedy=True,
                             temperature=self.temperature, max_new_tokens=self.max_new_tokens, seed=self.seed)
        greedy = gather_sharded(trainer, [float(v) for v in out.greedy], len(tasks))
        sampled = gather_sharded(trainer, [c / self.n_samples for c in out.correct], len(tasks)) \
            if self.n_samples else []
        result: Measurement = {}
        for i, t in enumerate(tasks):
            fam = result.setdefault(t.family, {"task_ids": [], "greedy": [], "sampled": []})
            fam["task_ids"].append(t.task_id)
            fam["greedy"].append(greedy[i])
            if sampled:
                fam["sampled"].append(sampled[i])
        return result

    def compare(self, trainer: pl.Trainer, current: Measurement) -> dict[str, Any]:
        if self.baseline is None:
            raise RuntimeError("no baseline measurement yet")
        report = compare_families(self.baseline, current, alpha=self.alpha, min_effect=self.min_effect,
                                  confidence=self.confidence, n_boot=self.n_boot, seed=self.seed,
                                  roles=family_roles(trainer))
        report["step"] = trainer.global_step
        return report

    # --- hooks -----------------------------------------------------------------------------------------------------
    def measure_baseline(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Measurement:
        """The starting weights' measurement: from `baseline_cache` when an entry for exactly these weights, tasks,
        settings and code exists, else measured (and stored). Rank 0 decides and broadcasts, so all ranks agree."""
        if not self.baseline_cache:
            return self.measure(trainer, pl_module)
        tasks = resolve_eval_tasks(trainer, self.split, self.per_family, self.families, self.seed)
        settings = {"measurement": "RegressionCallback baseline", "tasks": eval_cache.task_identities(tasks),
                    "n_samples": self.n_samples, "temperature": self.temperature,
                    "max_new_tokens": self.max_new_tokens, "seed": self.seed,
                    "verifier_timeout_s": self.verifier_settings.timeout_s}
        measurement, entry = eval_cache.cached_or_computed(trainer, self.baseline_cache, pl_module.model, settings,
                                                           lambda: self.measure(trainer, pl_module))
        if entry is not None:
            self.baseline_cached_at = str(entry)
            rank_zero_info(f"[regression] baseline measurement reused from {entry}")
        return measurement

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.baseline = self.measure_baseline(trainer, pl_module)
        self.baseline_step = trainer.global_step
        self._log_metrics(trainer, {f"{self.prefix}/baseline/{fam}": float(np.mean(m["greedy"]))
                                    for fam, m in self.baseline.items()})
        self._log_summary(trainer, self.baseline, "before")

    def _log_metrics(self, trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        """Straight to the logger (rank zero): also from hooks where `LightningModule.log` is not allowed."""
        logger = trainer.logger
        if logger is not None and not isinstance(logger, DummyLogger) and trainer.is_global_zero and metrics:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _log_summary(self, trainer: pl.Trainer, measurement: Measurement, when: str) -> None:
        if when == "after":
            self.last_measurement = measurement
        counts = summary_counts(measurement, family_roles(trainer), self.n_samples)
        self._log_metrics(trainer, summary_rates(counts, f"{self.prefix}/{when}"))

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or self.baseline is None:
            return
        self._evals += 1
        if self.every_n_evals == 0 or (self._evals - 1) % self.every_n_evals:
            return
        current = self.measure(trainer, pl_module)
        self._log_summary(trainer, current, "after")
        report = self.compare(trainer, current)
        self.history.append(report)
        for fam, row in report["families"].items():
            pl_module.log(f"{self.prefix}/{fam}/delta", float(row["delta"]))
            pl_module.log(f"{self.prefix}/{fam}/p_holm", float(row["p_holm"]))
        pl_module.log(f"{self.prefix}/flagged", float(len(report["flagged"])))
        self._write_text(trainer, report)
        if report["flagged"]:
            details = "; ".join(f"{f}: {report['families'][f]['baseline_greedy']:.2f} -> "
                                f"{report['families'][f]['current_greedy']:.2f} (Holm p="
                                f"{format_p(report['families'][f]['p_holm'])})" for f in report["flagged"])
            rank_zero_warn(f"significant regression at step {trainer.global_step}: {details}")
            if self.stop_on_regression:
                self.stopped_at = trainer.global_step
                trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.baseline is None:
            return
        if self.evaluate_at_end and (not self.history or self.history[-1]["step"] != trainer.global_step):
            current = self.measure(trainer, pl_module)
            self._log_summary(trainer, current, "after")
            self.history.append(self.compare(trainer, current))
        quiet = bool(getattr(trainer, "fast_dev_run", False)) and not self.output_dir  # fast_dev_run writes nothing
        if trainer.is_global_zero and not quiet:
            self.write_reports(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        close_own_verifier(self._own)

    # --- reports ---------------------------------------------------------------------------------------------------
    def report_dir(self, trainer: pl.Trainer) -> Path:
        if self.output_dir:
            return Path(self.output_dir)
        logger = trainer.logger
        # the logger's own log_dir, not trainer.log_dir: that one is a DDP collective and only rank 0 writes here
        log_dir = None if logger is None or isinstance(logger, DummyLogger) else getattr(logger, "log_dir", None)
        if log_dir:
            return Path(log_dir)
        return Path(trainer.default_root_dir)

    def write_reports(self, trainer: pl.Trainer) -> Path | None:
        """Write regression_report.json (baseline and last measurement per task, every comparison) and
        regression_report.md (the last comparison)."""
        if not self.history:
            return None
        out = self.report_dir(trainer)
        out.mkdir(parents=True, exist_ok=True)
        final = dict(self.history[-1])
        final["run"] = {"baseline step": self.baseline_step, "final step": final["step"],
                        "stopped early at": self.stopped_at, "split": self.split or "datamodule eval split",
                        "sampled per task": self.n_samples}
        if self.baseline_cached_at:
            final["run"]["baseline reused from"] = self.baseline_cached_at
        payload = {"baseline_step": self.baseline_step, "baseline": self.baseline, "final": final,
                   "final_measurement": self.last_measurement, "n_samples": self.n_samples,
                   "history": self.history, "stopped_at": self.stopped_at}
        (out / "regression_report.json").write_text(json.dumps(payload, indent=2, default=_json_default))
        (out / "regression_report.md").write_text(markdown_report(final))
        return out

    def _write_text(self, trainer: pl.Trainer, report: dict[str, Any]) -> None:
        logger = trainer.logger
        writer = getattr(logger, "experiment", None) if not isinstance(logger, DummyLogger) else None
        if writer is not None and hasattr(writer, "add_text") and trainer.is_global_zero:
            writer.add_text(f"{self.prefix}/report", markdown_report(report), trainer.global_step)


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
