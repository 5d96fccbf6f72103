"""RL budgets (issue 47): a completion budget counts every group drawn, zero-spread groups included, and ends the run
with a final evaluation; a step budget still counts optimizer steps and now also ends with one; the trained
temperature is a setting. Each runs a tiny real fit with a stand-in verifier whose verdicts make chosen groups
zero-spread."""

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from datamodules.rl_prompts import RLPromptDataModule
from glm_lightning.cli import main
from glm_lightning.evaluation import VerifierSettings
from glm_lightning.modules.rl import RLModule
from glm_lightning.modules.rl_budget import Budget, BudgetCounter
from glm_lightning.rl.config import PolicyLoss, Sampling
from glm_lightning.verifier import Verdict

CONF = str(Path(__file__).parent / "conf" / "rl_tiny.yaml")


def _flat_then_mixed(flat_batches: int):
    """Stand-in verifier: the first `flat_batches` batches all pass (every group zero-spread: no optimizer step),
    later ones alternate pass/fail (every group informative)."""
    calls = {"n": 0}

    def score(self, rollouts):
        calls["n"] += 1
        flat = calls["n"] <= flat_batches
        return [Verdict("passed", 1, 1) if flat or i % 2 == 0 else Verdict("failed", 0, 1)
                for i in range(len(rollouts.texts))]
    return score


class _Record(Callback):
    """Which batches ran and at which batch index each validation ran."""

    def __init__(self) -> None:
        self.batches, self.validations = 0, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.batches += 1

    def on_validation_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        self.validations.append(self.batches)


def _fit(tmp_path, budget: Budget, max_steps: int, val_check_interval: int, prompts: int = 8,
         loss: PolicyLoss | None = None, temperature: float = 1.0) -> tuple[RLModule, Trainer, _Record]:
    torch.manual_seed(0)
    module = RLModule(preset="tiny", model_overrides={"max_seq_len": 192}, lr=1e-3, min_lr_ratio=1.0,
                      warmup_steps=0, weight_decay=0.0, sampling=Sampling(group_size=2, temperature=temperature,
                                                                         max_new_tokens=4),
                      loss=loss or PolicyLoss(), verifier=VerifierSettings(workers=1), budget=budget,
                      log_samples_every_n_steps=0)
    dm = RLPromptDataModule(train_families=["increment", "double"], monitor_families=[],
                            prompts_per_family=prompts // 2, eval_per_family=1, batch_size=1)
    record = _Record()
    trainer = Trainer(accelerator="cpu", max_steps=max_steps, val_check_interval=val_check_interval,
                      check_val_every_n_epoch=None, num_sanity_val_steps=0, log_every_n_steps=1,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      logger=False, default_root_dir=tmp_path, limit_val_batches=1, callbacks=[record])
    trainer.fit(module, datamodule=dm)
    return module, trainer, record


def test_completion_budget_counts_zero_spread_groups_and_evaluates_at_the_end(tmp_path, monkeypatch):
    monkeypatch.setattr(RLModule, "score", _flat_then_mixed(flat_batches=2))
    module, trainer, record = _fit(tmp_path, Budget(completions=6), max_steps=-1, val_check_interval=100)
    # 6 completions at G 2 = 3 prompt groups drawn: 2 zero-spread (counted, no step) and 1 update
    assert record.batches == 3
    assert (module.budget.completions, module.budget.prompts) == (6, 3)
    assert trainer.global_step == 1
    assert module._groups_skipped == 2
    assert record.validations == [3]  # one evaluation, after the last batch (val_check_interval never fires)
    logged = trainer.logged_metrics
    assert float(logged["train/completions"]) == 6 and float(logged["train/optimizer_steps"]) == 1


def test_step_budget_draws_past_zero_spread_batches_and_evaluates_after_the_last_step(tmp_path, monkeypatch):
    monkeypatch.setattr(RLModule, "score", _flat_then_mixed(flat_batches=2))
    module, trainer, record = _fit(tmp_path, Budget(), max_steps=3, val_check_interval=2)
    # a step budget counts updates: 2 flat batches make none, so 5 batches are drawn for 3 steps
    assert trainer.global_step == 3 and record.batches == 5
    assert module.budget.completions == 10
    assert record.validations == [2, 4, 5]  # every 2 batches, and once more after the last step


def test_budget_settings_are_checked():
    with pytest.raises(ValueError, match="not both"):
        Budget(completions=8, prompts=4)
    with pytest.raises(ValueError, match="int >= 1"):
        Budget(completions=0)
    assert (Budget().unit, Budget(prompts=3).unit, Budget(completions=3).unit) == ("steps", "prompts", "completions")
    with pytest.raises(ValueError, match="trainer.max_steps: -1"):
        BudgetCounter(Budget(completions=128)).check_trainer(16)
    BudgetCounter(Budget(completions=128)).check_trainer(-1)


def test_completion_budget_from_yaml(tmp_path, monkeypatch):
    monkeypatch.setattr(RLModule, "score", _flat_then_mixed(flat_batches=1))
    main(["fit", "--config", CONF, "--trainer.max_steps", "-1", "--model.init_args.budget.completions", "8",
          "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path)])


def _spy_temperatures(monkeypatch) -> list[float]:
    import glm_lightning.rl.batch as batch_module

    seen: list[float] = []
    real = batch_module.grouped_completion_logprobs

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003
        seen.append(args[5] if len(args) > 5 else kwargs.get("temperature", 1.0))
        return real(*args, **kwargs)
    monkeypatch.setattr(batch_module, "grouped_completion_logprobs", spy)
    return seen


@pytest.mark.parametrize(("setting", "expected"), [("sampling", 0.2), (1.0, 1.0), ("1.0", 1.0)])
def test_trained_temperature_is_a_setting(tmp_path, monkeypatch, setting, expected):
    monkeypatch.setattr(RLModule, "score", _flat_then_mixed(flat_batches=0))
    seen = _spy_temperatures(monkeypatch)
    _fit(tmp_path, Budget(prompts=2), max_steps=-1, val_check_interval=100,
         loss=PolicyLoss(kl_coef=0.1, train_temperature=setting), temperature=0.2)
    assert seen and set(seen) == {expected}  # policy and reference log-probs alike


def test_trained_temperature_changes_the_gradient():
    """At T 0.2 the two objectives train different functions of the logits, not a rescaled copy of one."""
    logits = torch.tensor([[2.0, 1.0, 0.0]], requires_grad=True)
    grads = []
    for t in (0.2, 1.0):
        logits.grad = None
        (logits / t).log_softmax(-1)[0, 0].backward()
        grads.append(logits.grad.clone())
    cos = torch.nn.functional.cosine_similarity(grads[0], grads[1])
    assert float(cos) < 0.999
    assert PolicyLoss(train_temperature=1.0).trained_temperature(0.2) == 1.0
    assert PolicyLoss().trained_temperature(0.2) == 0.2
    for bad in ("hot", 0, -1.0, True):
        with pytest.raises(ValueError, match="train_temperature"):
            PolicyLoss(train_temperature=bad)
