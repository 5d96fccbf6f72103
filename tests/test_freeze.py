"""FreezeCallback: frozen weights stay bit-identical through real optimizer steps while the trainable ones move, the
optimizer only sees trainable parameters, unfreeze_at_epoch adds param groups that follow the schedule, counts are
logged, and bad patterns fail clearly (also when configured through the CLI)."""

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from callbacks.freeze import FreezeCallback
from datamodules.digits import DigitsDataModule
from glm_lightning.cli import main
from glm_lightning.modules.vision import VisionModule

CONF = str(Path(__file__).parent / "conf" / "vision_tiny.yaml")
TRAIN = ["vision.*", "model.blocks.3.*", "model.final_norm.*"]


def _module() -> VisionModule:
    torch.manual_seed(0)
    return VisionModule(preset="tiny", vision={"dim": 32, "heads": 2, "depth": 1}, warmup_steps=1, lr=1e-2)


def _data() -> DigitsDataModule:
    return DigitsDataModule(max_samples=60, batch_size=8, augment=False)


def _trainer(callbacks, **kwargs) -> pl.Trainer:
    defaults = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                    num_sanity_val_steps=0)
    return pl.Trainer(callbacks=callbacks, **{**defaults, **kwargs})


def test_frozen_weights_stay_bit_identical_and_trainable_ones_change(tmp_path):
    m = _module()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    bias_before = {n: b.clone() for n, b in m.named_buffers() if n.endswith("expert_bias")}
    cb = FreezeCallback(train=TRAIN)
    logger = TensorBoardLogger(str(tmp_path), name="freeze", default_hp_metric=False)
    _trainer([cb], max_steps=3, logger=logger).fit(m, datamodule=_data())

    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert trainable == cb.trainable_names
    assert all(n.startswith(("vision.", "model.blocks.3.", "model.final_norm.")) for n in trainable)
    assert "model.embed.weight" not in trainable
    for n, p in m.named_parameters():
        if n not in trainable:
            assert torch.equal(p, before[n]), f"frozen {n} changed"
    changed = {n for n in trainable if not torch.equal(m.get_parameter(n), before[n])}
    assert {"vision.patch_embed.weight", "vision.merger.fc2.weight", "model.final_norm.weight"} <= changed
    assert len(changed) > 0.5 * len(trainable)
    # frozen MoE layers keep their selection bias (no balancing updates), the trained one moved
    for n, b in m.named_buffers():
        if n.endswith("expert_bias") and not n.startswith("model.blocks.3."):
            assert torch.equal(b, bias_before[n]), n
    # the optimizer was built from trainable parameters only
    opt_params = {id(p) for g in m.trainer.optimizers[0].param_groups for p in g["params"]}
    assert opt_params == {id(m.get_parameter(n)) for n in trainable}
    # counts: printed and logged
    assert cb.trainable_params == sum(m.get_parameter(n).numel() for n in trainable)
    assert cb.total_params == sum(p.numel() for p in m.parameters()) > cb.trainable_params
    assert logger.hparams["freeze/trainable_params"] == cb.trainable_params
    assert logger.hparams["freeze/total_params"] == cb.total_params
    assert f"freeze/trainable_params: {cb.trainable_params}" in Path(logger.log_dir, "hparams.yaml").read_text()


class _Snapshot(pl.Callback):
    def __init__(self, names):
        self.names, self.after_epoch0, self.groups_epoch0 = names, {}, None

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            self.after_epoch0 = {n: pl_module.get_parameter(n).detach().clone() for n in self.names}
            self.groups_epoch0 = len(trainer.optimizers[0].param_groups)


def test_unfreeze_at_epoch_adds_param_groups():
    m = _module()
    later = ["model.final_norm.weight", "model.blocks.3.moe.w_gate_up", "model.blocks.3.moe.router_weight"]
    initial = {n: m.get_parameter(n).detach().clone() for n in later}
    cb = FreezeCallback(train=["vision.*"], unfreeze=["model.final_norm.*", "model.blocks.3.moe.*"],
                        unfreeze_at_epoch=1, unfreeze_lr_factor=0.5)
    snap = _Snapshot(later)
    trainer = _trainer([cb, snap], max_epochs=2, limit_train_batches=2)
    trainer.fit(m, datamodule=_data())

    assert snap.groups_epoch0 == 2  # the module's decay / no-decay groups
    for n in later:
        assert torch.equal(snap.after_epoch0[n], initial[n]), f"{n} trained before its epoch"
        assert not torch.equal(m.get_parameter(n), initial[n]), f"{n} did not train after unfreezing"
        assert m.get_parameter(n).requires_grad
    opt = trainer.optimizers[0]
    assert len(opt.param_groups) == 4  # + one decay and one no-decay group
    new = opt.param_groups[2:]
    base = opt.param_groups[0]["initial_lr"]
    assert all(g["initial_lr"] == pytest.approx(0.5 * base) for g in new)
    assert sorted(g["weight_decay"] for g in new) == [0.0, pytest.approx(m.hparams.weight_decay)]
    added = {id(p) for g in new for p in g["params"]}
    assert id(m.get_parameter("model.blocks.3.moe.w_gate_up")) in added
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert len(sched.lr_lambdas) == len(sched.base_lrs) == 4
    ratio = opt.param_groups[2]["lr"] / opt.param_groups[0]["lr"]
    assert ratio == pytest.approx(0.5)  # the new groups follow the same schedule multiplier
    assert cb.unfrozen_names
    assert all(n.startswith(("model.final_norm.", "model.blocks.3.moe.")) for n in cb.unfrozen_names)


def test_bad_patterns_and_arguments_raise():
    m = _module()
    with pytest.raises(ValueError, match="matches no parameter"):
        FreezeCallback(train=["vision.*", "nothing.here.*"]).freeze_before_training(m)
    with pytest.raises(ValueError, match="unfreeze pattern"):
        FreezeCallback(train=["vision.*"], unfreeze=["model.nope.*"], unfreeze_at_epoch=1).freeze_before_training(m)
    with pytest.raises(ValueError, match="glob patterns"):
        FreezeCallback(train="vision.*")
    with pytest.raises(ValueError, match="glob patterns"):
        FreezeCallback(train=[])
    with pytest.raises(ValueError, match="together"):
        FreezeCallback(train=["vision.*"], unfreeze=["model.*"])
    with pytest.raises(ValueError, match="together"):
        FreezeCallback(train=["vision.*"], unfreeze_at_epoch=2)
    with pytest.raises(ValueError, match=">= 0"):
        FreezeCallback(train=["vision.*"], unfreeze=["model.*"], unfreeze_at_epoch=-1)
    with pytest.raises(ValueError, match="unfreeze_lr_factor"):
        FreezeCallback(train=["vision.*"], unfreeze_lr_factor=0)


def test_through_the_cli(tmp_path):
    args = ["fit", "--config", CONF, "--trainer.fast_dev_run", "1", "--trainer.default_root_dir", str(tmp_path),
            "--trainer.callbacks+=callbacks.freeze.FreezeCallback",
            "--trainer.callbacks.train", '["vision.*", "model.final_norm.*"]']
    main(args)
    with pytest.raises(ValueError, match="matches no parameter"):
        main(args[:-1] + ['["vision.*", "model.blocks.99.*"]'])
