"""Weights that an optimizer changes between two generations are the weights the second generation uses.

Fused AdamW writes parameters in place without bumping their version counters, so any cache of derived weights
keyed on (id, data_ptr, _version) silently keeps the old values: greedy dev evaluation during pre-training and RL
rollouts after an update then decode with stale weights while training looks fine. The check: after an optimizer
step, cached decoding of the trained model equals the full forward of a fresh model built from its state dict."""

from __future__ import annotations

import copy

import pytest
import torch

from glm_lightning.generation import generate, generate_naive
from glm_lightning.lora import apply_lora
from glm_lightning.model.config import GLMConfig
from glm_lightning.model.model import GLMModel


def _train_step(model: GLMModel, ids: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    model.train()
    logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    model.eval()


@pytest.mark.parametrize("lora", [False, True])
def test_generation_after_a_fused_adamw_step_uses_the_new_weights(lora):
    torch.manual_seed(0)
    model = GLMModel(GLMConfig.preset("tiny", layer_pattern="LLLS")).eval()
    if lora:
        apply_lora(model, ["blocks.*.mixer.[qkv]_proj.weight"], rank=4)
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=5e-2, fused=True)
    prompt = torch.randint(4, 200, (2, 12))
    train_ids = torch.randint(4, 200, (4, 24))
    with torch.no_grad():
        before = generate(model, prompt, max_new_tokens=8, eos_id=None).tokens
    for _ in range(3):
        _train_step(model, train_ids, opt)
    fresh = copy.deepcopy(model)  # new modules, new tensors: no cache from before the steps can survive
    with torch.no_grad():
        after_cached = generate(model, prompt, max_new_tokens=8, eos_id=None).tokens
        reference = generate_naive(fresh, prompt, max_new_tokens=8, eos_id=None)
    assert torch.equal(after_cached, reference), (after_cached, reference)
    assert not torch.equal(before, after_cached), "the steps were meant to change the greedy tokens"
