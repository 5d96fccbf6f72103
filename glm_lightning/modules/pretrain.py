"""PretrainModule: next-token pre-training of the shared model on code corpora.

loss = cross-entropy over non-pad targets + the model's aux_loss (MoE balance + DSA indexer KL). After every
optimizer step the MoE selection biases take one aux-loss-free balancing step. Validation reports loss,
bits-per-byte and teacher-forced accuracy over completion bytes; on function corpora it also generates greedy
completions for held-out task identities and runs them in the sandboxed verifier (`val/dev_pass`, per family), and
with `data.heldout_per_family` the same for families the corpus never shows (`val/heldout_pass`: generalisation).

Dashboards: `train/tokens_seen` continues across a resume (it is saved in the checkpoint), the per-layer
`experts/max_over_mean_layer{i}` is logged every logging step (the histograms every `expert_histogram_every_n_steps`),
and the dev-sample table rotates over all task families from one validation to the next. `time/train_minutes` (wall
minutes spent in fit, continued across a resume) is logged at every validation, so dev pass can be read against
wall-clock time; `val/families_solved` counts families whose dev tasks all pass and `val/families_majority` those
with more than half passing (with one dev task per family, as in the tutorial, the two are the same).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric

from glm_lightning.evaluation import VerifierSettings, code_cell, pass_rates, sample_completions, verify_samples
from glm_lightning.modules.base import StageModule

IGNORE = -100


class PretrainModule(StageModule):
    """Pre-training stage. Batches: `input_ids`, `targets` (-100 = ignore), `completion_mask` [B, T]."""

    starts_from_scratch = True

    def __init__(
        self,
        init_weights: str | None = None,
        dev_eval: bool = True,
        dev_max_new_tokens: int = 48,
        verifier: VerifierSettings = VerifierSettings(),  # noqa: B008 - frozen dataclass
        samples_in_log: int = 8,
        expert_histogram_every_n_steps: int = 50,
        **kwargs: Any,
    ) -> None:
        """
        Args:
            init_weights: checkpoint whose model weights to start from (default: random weights).
            dev_eval: at each validation, generate greedy completions of the datamodule's dev tasks and verify them.
            dev_max_new_tokens: completion budget of that evaluation.
            verifier: sandboxed verifier settings.
            samples_in_log: rows of the dev-sample text table.
            expert_histogram_every_n_steps: period of the per-layer expert-load histograms (0 = never).
            **kwargs: the shared stage arguments (`StageModule`: preset, model_overrides, init_weights, lr, ...).
        """
        super().__init__(init_weights=init_weights, **kwargs)
        self.val_loss = MeanMetric()
        self.val_bpb, self.val_completion_acc = MeanMetric(), MeanMetric()
        self.verifier_settings = verifier
        self._tokens_seen = 0
        self._t_last: float | None = None
        self._sample_round = 0
        self._wall_before = 0.0  # fit seconds of earlier attempts (a resumed run continues the clock)
        self._fit_t0: float | None = None

    def promised_metrics(self, datamodule: Any) -> list[str]:
        """Every key this stage logs (`val/dev_pass` only when dev tasks are generated and verified)."""
        keys = ["train/*", "val/loss", "val/bpb", "val/completion_acc", "experts/*", "lr-*", "time/*"]
        hp = getattr(datamodule, "hparams", {})
        functions = self.hparams.dev_eval and hp.get("corpus", "functions") == "functions"
        if functions and hp.get("dev_per_family", 1):
            keys += ["val/dev_pass", "val/dev_pass/*", "val/families_solved", "val/families_majority"]
        if functions and hp.get("heldout_per_family", 0) and getattr(datamodule, "heldout_families", ()):
            keys += ["val/heldout_pass", "val/heldout_pass/*"]
        return keys

    def metric_hint(self, key: str) -> str:
        if key.startswith("val/dev_pass") and not self.hparams.dev_eval:
            return " (model.init_args.dev_eval is false)"
        if key.startswith("val/dev_pass"):
            return " (dev tasks exist only for data.init_args.corpus: functions with dev_per_family > 0)"
        if key.startswith("val/heldout_pass"):
            return " (held-out family tasks need data.init_args.heldout_per_family > 0 and model.init_args.dev_eval)"
        return ""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["tokens_seen"] = self._tokens_seen
        checkpoint["train_seconds"] = self.train_seconds()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._tokens_seen = int(checkpoint.get("tokens_seen", 0))
        self._wall_before = float(checkpoint.get("train_seconds", 0.0))

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self._fit_t0 = time.perf_counter()

    def train_seconds(self) -> float:
        """Wall seconds spent in fit so far, earlier attempts of a resumed run included."""
        now = time.perf_counter()
        return self._wall_before + (now - self._fit_t0 if self._fit_t0 is not None else 0.0)

    # --- losses -------------------------------------------------------------------------------------------------
    def _losses(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self.model(batch["input_ids"])
        logits = out.logits.float()
        ce = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=IGNORE)
        return ce, out.aux_loss, logits

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ce, aux, _ = self._losses(batch)
        n_tokens = int((batch["targets"] != IGNORE).sum())
        self.log("train/loss", ce, prog_bar=True)
        self.log("train/aux_loss", aux)
        self.log("train/bpb", ce / math.log(2))
        self._log_throughput(n_tokens)
        return ce + aux

    def _log_throughput(self, n_tokens: int) -> None:
        now = time.perf_counter()
        if self._t_last is not None and now > self._t_last:
            self.log("train/tokens_per_s", n_tokens / (now - self._t_last), prog_bar=True)
        self._t_last = now
        self._tokens_seen += n_tokens
        self.log("train/tokens_seen", float(self._tokens_seen))

    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        # called once per optimizer step, after step(): one aux-loss-free balancing update from this step's loads
        if self.training:
            self.model.update_balance_bias()
            every = self.hparams.expert_histogram_every_n_steps
            self._log_expert_loads(histograms=bool(every) and self.global_step % every == 0)

    def _log_expert_loads(self, histograms: bool) -> None:
        """max/mean expert load per layer from this step's routing (so the curve is current at every logging step);
        the load histograms only when asked (they are large)."""
        writer = getattr(self.logger, "experiment", None) if histograms else None
        for layer, load in self.model.expert_loads().items():
            if load is None or not load.numel():
                continue
            self.log(f"experts/max_over_mean_layer{layer}", float(load.max() * load.numel()))
            if writer is not None and hasattr(writer, "add_histogram"):
                # one histogram per layer: expert index weighted by its share of routed tokens
                idx = torch.arange(load.numel(), dtype=torch.float)
                writer.add_histogram(f"experts/load_layer{layer}", idx.repeat_interleave(
                    (load.float() * 1000).round().long().clamp(min=0)), self.global_step)

    # --- validation ---------------------------------------------------------------------------------------------
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        ce, _, logits = self._losses(batch)
        n_tokens = int((batch["targets"] != IGNORE).sum())
        self.val_loss(ce, n_tokens)
        self.val_bpb(ce / math.log(2), n_tokens)
        mask = batch["completion_mask"]
        if mask.any():
            correct = (logits.argmax(-1) == batch["targets"])[mask].float()
            self.val_completion_acc(correct.mean(), correct.numel())
        self.log("val/loss", self.val_loss, prog_bar=True)
        self.log("val/bpb", self.val_bpb)
        self.log("val/completion_acc", self.val_completion_acc, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        if self.hparams.dev_eval:
            self._dev_pass()
        # after the dev evaluation: the minute at which this validation's numbers were known
        self.log("time/train_minutes", self.train_seconds() / 60)

    def _dev_pass(self) -> None:
        """Greedy completions of the datamodule's dev tasks, verified; pass rate overall, per family, and the
        number of families solved. Then the same for the never-trained families' tasks (`val/heldout_pass`)."""
        tasks = list(getattr(self.trainer.datamodule, "dev_tasks", None) or [])
        if tasks:
            rates, sampled, verdicts = self._greedy_pass(tasks)
            self.log("val/dev_pass", rates.pop("all"), prog_bar=True)
            self.log_dict({f"val/dev_pass/{fam}": r for fam, r in rates.items()})
            self.log("val/families_solved", float(sum(r == 1.0 for r in rates.values())), prog_bar=True)
            self.log("val/families_majority", float(sum(r > 0.5 for r in rates.values())))
            self._log_samples(sampled, verdicts)
        heldout = list(getattr(self.trainer.datamodule, "heldout_tasks", None) or [])
        if heldout:
            rates, _, _ = self._greedy_pass(heldout)
            self.log("val/heldout_pass", rates.pop("all"))
            self.log_dict({f"val/heldout_pass/{fam}": r for fam, r in rates.items()})

    def _greedy_pass(self, tasks: list[Any]) -> tuple[dict[str, float], list[Any], list[list[Any]]]:
        sampled = sample_completions(self.model, tasks, max_new_tokens=self.hparams.dev_max_new_tokens)
        verdicts = verify_samples(self.verifier, sampled)
        return pass_rates(tasks, [v[0].status == "passed" for v in verdicts]), sampled, verdicts

    def _log_samples(self, sampled: list[Any], verdicts: list[list[Any]]) -> None:
        writer = getattr(self.logger, "experiment", None)
        if writer is None or not hasattr(writer, "add_text"):
            return
        rows = ["| task | verdict | completion |", "|---|---|---|"]
        picked = rotating_sample(list(zip(sampled, verdicts)), [s.task.family for s in sampled],
                                 self.hparams.samples_in_log, self._sample_round)
        self._sample_round += 1
        for s, v in picked:
            rows.append(f"| `{s.task.entry_point}` | {v[0].status} ({v[0].passed_cases}/{v[0].total_cases}) "
                        f"| {code_cell(s.completions[0])} |")
        writer.add_text("samples/dev", "\n".join(rows), self.global_step)


def rotating_sample(items: Sequence[Any], families: Sequence[str], rows: int, round_: int) -> list[Any]:
    """`rows` items spread over the families round-robin, starting one family further (and one item deeper) each
    round, so consecutive rounds show every family even when `rows` is smaller than the number of families."""
    by_family: dict[str, list[Any]] = defaultdict(list)
    for item, fam in zip(items, families):
        by_family[fam].append(item)
    fams = sorted(by_family)
    rows = min(rows, len(items))
    if not fams or rows <= 0:
        return []
    picked, start = [], (round_ * rows) % len(fams)
    taken: dict[str, int] = defaultdict(int)
    while len(picked) < rows:
        fam = fams[(start + len(picked)) % len(fams)]
        pool = by_family[fam]
        if taken[fam] < len(pool):
            picked.append(pool[(round_ + taken[fam]) % len(pool)])
            taken[fam] += 1
        else:
            start += 1  # this family is used up; move on
    return picked
