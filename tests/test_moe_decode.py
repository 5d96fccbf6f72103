"""A decode step's MoE layer as one C++ op (ops.moe_decode, csrc/moe_decode.cpp) against the ops one by one: the same
logits and cache bit for bit over a few decode steps, with fp32 panels and with the bf16 panels of the sampling copy."""

import pytest
import torch

from glm_lightning.generation import sampling_weights
from glm_lightning.model import GLMConfig, GLMModel, cext
from glm_lightning.model.ops import decode, moe as moe_ops

pytestmark = pytest.mark.skipif(not cext.available(), reason="C++ ops disabled (GLM_LIGHTNING_EXT=0) or not buildable")


def _steps(model: GLMModel, fused: bool, monkeypatch, rows: int, steps: int = 4) -> list[torch.Tensor]:
    """Logits of a prefill and `steps` decode steps, then the cache's state tensors; `fused`: the one-op MoE on."""
    blocks = tuple(decode.ENTRY_PARTS)  # the block ops call moe_decode from C++ (tests/test_block_decode.py)
    ops = tuple(op for op in decode.OPS if op not in blocks and (fused or op != "moe_decode"))
    monkeypatch.setattr(decode, "OPS", ops)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (rows, 7), generator=gen)
    out = []
    with torch.inference_mode():
        cache = model.new_cache(rows)
        out.append(model(prompt, cache=cache).logits)
        for _ in range(steps):
            out.append(model(out[-1][:, -1:].argmax(-1), cache=cache).logits)
    return out + [t for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("precision", ["32", "bf16"])
@pytest.mark.parametrize("shared", [True, False])
def test_moe_decode_equals_the_ops_one_by_one(monkeypatch, precision, shared):
    torch.manual_seed(0)
    cfg = GLMConfig.preset("tiny", layer_pattern="LS", index_top_k=4, **({} if shared else {"shared_expert_hidden": 0}))
    model = sampling_weights(GLMModel(cfg).eval(), precision)
    ran = []
    real = moe_ops.moe_decode

    def spy(*args):
        y = real(*args)
        ran.append((bool(decode._on), y is not None))  # (in a decode step, the op ran)
        return y

    monkeypatch.setattr(moe_ops, "moe_decode", spy)
    monkeypatch.setattr("glm_lightning.model.ops.moe_decode", spy)
    fused = _steps(model, True, monkeypatch, rows=5)
    assert (True, True) in ran and all(step == done for step, done in ran)  # each decode step's layers, no prefill
    ran.clear()
    general = _steps(model, False, monkeypatch, rows=5)
    assert (True, False) in ran and not any(done for _, done in ran)
    for a, b in zip(fused, general, strict=True):
        assert torch.equal(a, b)


def test_moe_decode_off_without_its_parts(monkeypatch):
    """The op table switching off one kernel the op calls switches the fused op off (its values are that path's)."""
    from glm_lightning.model.ops import backend

    with backend.cpp_ops_off(("swiglu",)), decode.fp32_step(True):
        assert not decode.cpp("moe_decode")
    with decode.fp32_step(True):
        assert decode.cpp("moe_decode")
