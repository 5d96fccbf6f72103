"""LoRA adapters: identity at start, the textbook W + (alpha/r) B A, trainable alone, merge == unmerged outputs."""

from __future__ import annotations

import pytest
import torch

from glm_lightning.lora import apply_lora, lora_parameters, merge_lora
from glm_lightning.model import GLMConfig, GLMModel

PATTERNS = ["blocks.*.mixer.[qkvo]_proj.weight"]


def _model(seed: int = 0) -> GLMModel:
    torch.manual_seed(seed)
    return GLMModel(GLMConfig.preset("tiny")).eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


def test_identity_at_init_and_only_matrices_matched():
    model = _model()
    ids = _ids()
    with torch.no_grad():
        before = model(ids).logits
    names = apply_lora(model, PATTERNS, rank=4, alpha=8)
    assert names and all(n.endswith("_proj.weight") for n in names)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)  # B = 0: exactly the original model


def test_weight_is_textbook_formula():
    model = _model()
    name = apply_lora(model, PATTERNS, rank=4, alpha=8)[0]
    module = model.get_submodule(name.rpartition(".")[0])
    delta = module.parametrizations.weight[0]
    torch.nn.init.normal_(delta.lora_B)
    w0 = module.parametrizations.weight.original
    expected = w0 + (8 / 4) * delta.lora_B @ delta.lora_A
    torch.testing.assert_close(module.weight, expected, rtol=0, atol=1e-6)


def test_adapters_train_alone_and_merge_keeps_outputs():
    model = _model()
    apply_lora(model, PATTERNS, rank=4, alpha=8)
    adapters = dict(lora_parameters(model))
    for n, p in model.named_parameters():
        p.requires_grad_(n in adapters)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if n not in adapters}
    opt = torch.optim.SGD([p for p in adapters.values()], lr=0.5)
    ids = _ids()
    for _ in range(2):
        logits = model(ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert any(p.abs().sum() > 0 for n, p in adapters.items() if "lora_B" in n)  # the adapters moved
    with torch.no_grad():
        adapted = model(ids).logits
        assert merge_lora(model) == len([n for n in adapters if n.endswith("lora_A")])
        assert not lora_parameters(model)
        torch.testing.assert_close(model(ids).logits, adapted, rtol=1e-5, atol=1e-5)
    assert set(model.state_dict()) == set(_model().state_dict())  # a plain model again: loads anywhere


def test_bad_patterns_are_clear_errors():
    model = _model()
    with pytest.raises(ValueError, match="matches no parameter; closest names"):
        apply_lora(model, ["blocks.*.mixer.qproj.weight"])
    with pytest.raises(ValueError, match="non-matrix"):
        apply_lora(model, ["blocks.0.*.A_log"])
    with pytest.raises(ValueError, match="rank"):
        apply_lora(model, PATTERNS, rank=0)
    with pytest.raises(ValueError, match="exceeds the smaller side"):
        apply_lora(model, ["blocks.0.mixer.b_proj.weight"], rank=64)
    apply_lora(model, PATTERNS, rank=2)
    with pytest.raises(ValueError, match="twice"):
        apply_lora(model, PATTERNS, rank=2)
