"""The decode's weight panels kept from one generation to the next (model/kept_panels.py): a later generation packs
nothing while the weights are unchanged, and samples exactly what a fresh copy of the model samples after any way of
changing them that the module docstring promises to see."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from glm_lightning.generation import generate, weights_changed
from glm_lightning.model import GLMConfig, GLMModel, cext, kept_panels
from glm_lightning.optim import AdamW

pytestmark = pytest.mark.skipif(not cext.available(), reason="C++ ops not available (no panels to keep)")

PROMPT = torch.tensor([[1, 72, 101, 108, 108, 111, 10, 32]])


def tiny() -> GLMModel:
    torch.manual_seed(0)
    return GLMModel(GLMConfig.preset("tiny", layer_pattern="LLLS")).eval()


def sample(model: GLMModel, seed: int = 0) -> torch.Tensor:
    """The log-probs of 3 sampled completions: they move with any change of a weight the decode reads."""
    gen = generate(model, PROMPT, max_new_tokens=5, temperature=1.0, num_samples=3,
                   generator=torch.Generator().manual_seed(seed))
    return gen.logprobs


def kept(model: GLMModel) -> kept_panels.KeptPanels:
    return kept_panels._kept[model]


def test_a_second_generation_packs_nothing():
    model = tiny()
    first = sample(model)
    panels = {id(held.value) for held in kept(model).panels.values()}
    derived = {id(held.value) for held in kept(model).derived.values()}
    assert len(panels) >= 4 * 4 and len(derived) == 2 * 3  # per layer: mixer and MoE matrices; KDA's two concats
    cache = model.new_cache(1)
    assert {id(v) for v in cache.packed.values()} == panels  # the next generation starts with every panel
    assert torch.equal(sample(model), first)
    assert {id(held.value) for held in kept(model).panels.values()} == panels  # ... and packed none again
    assert {id(held.value) for held in kept(model).derived.values()} == derived


def _fused_adamw(model: GLMModel) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)  # writes without bumping version counters
    model.train()
    model(PROMPT).logits.square().mean().backward()
    opt.step()
    model.eval()


def _project_adamw(model: GLMModel) -> None:
    opt = AdamW(model.parameters(), lr=1e-2)
    model.train()
    model(PROMPT).logits.square().mean().backward()
    opt.step()
    model.eval()


def _data_write(model: GLMModel) -> None:
    model.blocks[1].moe.w_down.data.mul_(1.5)  # untracked: `.data` has its own version counter


def _kda_input_projection(model: GLMModel) -> None:
    model.blocks[0].mixer.k_proj.weight.data.mul_(-1.0)  # a part of KDA's kept [W_q; W_k; W_v]


def _tracked_one_element(model: GLMModel) -> None:
    with torch.no_grad():
        model.blocks[3].mixer.o_proj.weight[0, 0] += 3.0


def _load_state_dict(model: GLMModel) -> None:
    torch.manual_seed(1)
    model.load_state_dict(GLMModel(model.cfg).state_dict())


def _replaced_parameter(model: GLMModel) -> None:
    lin = model.blocks[2].mixer.o_proj
    lin.weight = nn.Parameter(lin.weight.detach() * -2.0)


def _tied_embedding(model: GLMModel) -> None:
    model.embed.weight.data.add_(torch.randn_like(model.embed.weight) * 0.05)  # the logits' panels (tied head)


CHANGES = [_fused_adamw, _project_adamw, _data_write, _kda_input_projection, _tracked_one_element, _load_state_dict,
           _replaced_parameter, _tied_embedding]


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.strip("_"))
def test_a_changed_weight_is_packed_again(change):
    model = tiny()
    before = sample(model)
    assert len(kept(model)) > 0
    change(model)
    after = sample(model)
    assert torch.equal(after, sample(copy.deepcopy(model)))  # a copy kept nothing: it packs every weight afresh
    assert not torch.equal(after, before)  # the change reached the decode (else this test could not fail)


def test_an_untracked_write_to_one_element_needs_weights_changed():
    """The one change the panels cannot see by themselves (module docstring): `weights_changed` tells them."""
    model = tiny()
    sample(model)
    w = model.blocks[3].mixer.o_proj.weight
    version = w._version
    w.data[0, 1] += 3.0
    assert w._version == version
    weights_changed(model)
    after = sample(model)
    assert torch.equal(after, sample(copy.deepcopy(model)))


def test_panels_of_parameters_that_left_the_model_are_dropped():
    model = tiny()
    sample(model)
    old = model.blocks[2].mixer.o_proj.weight
    assert old in kept(model).panels
    model.blocks[2].mixer.o_proj.weight = nn.Parameter(old.detach().clone())
    model.new_cache(1)
    assert old not in kept(model).panels
    assert model.blocks[2].mixer.o_proj.weight not in kept(model).panels  # packed again on the next decode


def test_bf16_sampling_copy_keeps_its_panels_until_a_step():
    model = tiny()
    first = generate(model, PROMPT, max_new_tokens=4, temperature=1.0, num_samples=2, precision="bf16",
                     generator=torch.Generator().manual_seed(0)).logprobs
    again = generate(model, PROMPT, max_new_tokens=4, temperature=1.0, num_samples=2, precision="bf16",
                     generator=torch.Generator().manual_seed(0)).logprobs
    assert torch.equal(first, again)
    _project_adamw(model)
    after = generate(model, PROMPT, max_new_tokens=4, temperature=1.0, num_samples=2, precision="bf16",
                     generator=torch.Generator().manual_seed(0)).logprobs
    fresh = generate(copy.deepcopy(model), PROMPT, max_new_tokens=4, temperature=1.0, num_samples=2,
                     precision="bf16", generator=torch.Generator().manual_seed(0)).logprobs
    assert torch.equal(after, fresh) and not torch.equal(after, first)


def test_switched_off_nothing_is_kept(monkeypatch):
    monkeypatch.setattr(kept_panels, "KEEP", False)
    model = tiny()
    sample(model)
    assert model not in kept_panels._kept


def test_drop_frees_them():
    model = tiny()
    sample(model)
    kept_panels.drop_kept_panels(model)
    assert model not in kept_panels._kept
