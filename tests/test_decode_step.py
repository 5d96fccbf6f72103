"""The fp32 decode step's direct C++ calls (ops/decode.py: backend decided once per step) against the same step with
every op through its general entry: the same logits and cache bit for bit, each direct entry taken, and none outside
a decode step (prefill, autocast)."""

import pytest
import torch

from glm_lightning.model import GLMConfig, GLMModel, cext
from glm_lightning.model.ops import decode

pytestmark = pytest.mark.skipif(not cext.available(), reason="C++ ops disabled (GLM_LIGHTNING_EXT=0) or not buildable")


def _steps(model: GLMModel, direct: bool, monkeypatch, steps: int = 4) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Logits of a prefill and `steps` decode steps of 3 rows, and the cache's state tensors after them."""
    monkeypatch.setattr(decode, "OPS", decode.OPS if direct else ())
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (3, 12), generator=gen)
    out = []
    with torch.inference_mode():
        cache = model.new_cache(3)
        out.append(model(prompt, cache=cache).logits)
        for _ in range(steps):
            out.append(model(out[-1][:, -1:].argmax(-1), cache=cache).logits)
    states = [t for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    return out, states


@pytest.mark.parametrize("fused_moe", [True, False])
def test_direct_calls_equal_the_general_entries_bit_for_bit(monkeypatch, fused_moe):
    torch.manual_seed(0)
    model = GLMModel(GLMConfig.preset("tiny", layer_pattern="LLS", index_top_k=4)).eval()  # 12 > 4: sparse decode
    taken: set[str] = set()
    # the block ops off (tests/test_block_decode.py compares them): each op's own direct entry runs
    blocks = tuple(decode.ENTRY_PARTS)  # the block ops
    ops = tuple(op for op in decode.OPS if op not in blocks and (fused_moe or op != "moe_decode"))
    monkeypatch.setattr(decode, "OPS", ops)
    real = decode.cpp

    def cpp(op: str) -> bool:
        if real(op):
            taken.add(op)
        return real(op)

    monkeypatch.setattr(decode, "cpp", cpp)
    direct, direct_states = _steps(model, True, monkeypatch)
    assert taken == set(ops) - ({"moe_route"} if fused_moe else set())  # every direct entry ran (moe_decode routes)
    taken.clear()
    general, general_states = _steps(model, False, monkeypatch)
    assert not taken
    for a, b in zip(direct + direct_states, general + general_states, strict=True):
        assert torch.equal(a, b)


def test_direct_entries_are_on_only_inside_an_fp32_decode_step(monkeypatch):
    torch.manual_seed(0)
    model = GLMModel(GLMConfig.preset("tiny", layer_pattern="LS")).eval()
    seen: list[frozenset[str]] = []
    real = decode.cpp
    monkeypatch.setattr(decode, "cpp", lambda op: seen.append(decode._on) or real(op))
    ids = torch.randint(0, 256, (2, 5))
    with torch.inference_mode():
        cache = model.new_cache(2)
        model(ids, cache=cache)  # a prefill
        assert seen and not any(seen)
        seen.clear()
        model(ids[:, :1], cache=cache)  # a decode step
        assert seen and all(s == frozenset(decode.OPS) for s in seen)
        seen.clear()
        with torch.autocast("cpu", torch.bfloat16):
            model(ids[:, :1], cache=cache)
        assert seen and not any(seen)
    assert decode._on == frozenset()


def test_flash_decode_step_op_count_bound():
    """A flash-25m decode step's ATen ops (torch.profiler, deterministic; the shipped op table, as the tests pin):
    2,568 before the one-op site read and RoPE (issue 49), 1,824 after, 1,656 with the one-op MoE layer, 1,263 with
    the block ops (ops/block_decode.py); the bound catches a form that falls back."""
    from benchmarks.profile_decode import profile_decode

    n, _ = profile_decode(rows=2)
    assert n <= 1290
