"""The model runs wherever PyTorch runs: with the C++ ops switched off (``ops.cpp_ops(False)``, as on another device or
with GLM_LIGHTNING_EXT=0) a training step, a cached generation and a one-step Lightning fit give what they give with
the ops on, and a dtype the C++ ops do not take (bfloat16) runs through the PyTorch forms."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from datamodules import CodeCorpusDataModule
from glm_lightning.generation import generate
from glm_lightning.model import GLMConfig, GLMModel, cext, ops
from glm_lightning.modules import PretrainModule

needs_cpp = pytest.mark.skipif(not cext.available(), reason="C++ ops not built: nothing to compare with")


def _tiny(**kw) -> GLMModel:
    torch.manual_seed(0)
    return GLMModel(GLMConfig.preset("tiny", **kw))


def _train_step(cpp: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = _tiny()
    ids = torch.randint(0, 256, (3, 41), generator=torch.Generator().manual_seed(1))
    valid = torch.ones(3, 40, dtype=torch.bool)
    valid[1, :7] = False
    with ops.cpp_ops(cpp):
        out = model(ids[:, :-1], valid=valid)
        loss = F.cross_entropy(out.logits.flatten(0, 1), ids[:, 1:].flatten()) + out.aux_loss
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@needs_cpp
def test_training_step_with_the_cpp_ops_off_equals_on():
    loss_on, grads_on = _train_step(True)
    loss_off, grads_off = _train_step(False)
    torch.testing.assert_close(loss_off, loss_on, rtol=1e-5, atol=1e-5)
    assert grads_on.keys() == grads_off.keys() and len(grads_on) > 20
    for name in grads_on:
        torch.testing.assert_close(grads_off[name], grads_on[name], rtol=1e-4, atol=2e-5, msg=name)


@needs_cpp
def test_cached_generation_with_the_cpp_ops_off_equals_on():
    """Prefill with left padding, then decode steps (the DSA layer past its top-k, so sparse): the same greedy tokens
    and log-probs within float rounding, and with sampling the same tokens from the same seed."""
    model = _tiny().eval()
    prompts = torch.randint(32, 127, (2, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, :6] = False
    runs = {}
    for cpp in (True, False):
        with ops.cpp_ops(cpp):
            runs[cpp] = [generate(model, prompts, max_new_tokens=16, temperature=t, num_samples=2, eos_id=None,
                                  attention_mask=mask, generator=torch.Generator().manual_seed(3)) for t in (0.0, 1.0)]
    for on, off in zip(runs[True], runs[False]):
        assert torch.equal(on.tokens, off.tokens)
        torch.testing.assert_close(on.logprobs, off.logprobs, rtol=1e-4, atol=1e-5)


def _fit_one_step(cpp: bool, tmp_path) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    pl.seed_everything(0)
    module = PretrainModule(preset="tiny", model_overrides={"max_seq_len": 192}, dev_eval=False, lr=3e-3,
                            warmup_steps=1)
    data = CodeCorpusDataModule(families=["increment", "double"], num_examples=8, seq_len=192, batch_size=2,
                                val_per_family=1, dev_per_family=1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, default_root_dir=tmp_path)
    with ops.cpp_ops(cpp):
        trainer.fit(module, datamodule=data)
    return trainer.callback_metrics["train/loss"], {n: p.detach().clone() for n, p in module.model.named_parameters()}


@needs_cpp
def test_one_step_lightning_fit_with_the_cpp_ops_off_equals_on(tmp_path):
    """The same loss, and the same weights after AdamW's first step except where a gradient entry is ~0 and float
    rounding flips its sign (the first step is ~lr * sign(g)): 12 of 100,590 entries here, by at most 3.4e-5."""
    loss_on, on = _fit_one_step(True, tmp_path / "on")
    loss_off, off = _fit_one_step(False, tmp_path / "off")
    torch.testing.assert_close(loss_off, loss_on, rtol=1e-5, atol=1e-5)
    torch.manual_seed(0)
    start = dict(GLMModel(GLMConfig.preset("tiny", max_seq_len=192)).named_parameters())
    assert any(not torch.equal(on[n], start[n]) for n in on)  # the step changed the weights
    diffs = torch.cat([(off[n] - on[n]).abs().flatten() for n in on])
    assert float(diffs.max()) < 1e-4 and int((diffs > 1e-6).sum()) < 1e-3 * diffs.numel()


def test_bfloat16_model_runs_through_the_pytorch_forms():
    """bf16 tensors are not the C++ ops' dtype: a training step and a cached decode run, finite."""
    model = _tiny().to(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(4))
    out = model(ids[:, :-1])
    assert out.logits.dtype == torch.bfloat16
    loss = F.cross_entropy(out.logits.float().flatten(0, 1), ids[:, 1:].flatten()) + out.aux_loss.float()
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.inference_mode():
        gen = generate(model.eval(), ids[:, :12], max_new_tokens=4, eos_id=None)
    assert gen.tokens.shape == (2, 4)
