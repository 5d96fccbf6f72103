"""A decode step's blocks as one C++ op each (ops/block_decode.py, csrc/block_decode.cpp) against the same step with
the blocks' modules calling the ops one by one: the same logits and caches bit for bit over several decode steps, with
fp32 panels and the bf16 panels of the sampling copy, with padding rows (the KDA block falls back, the MoE half does
not), and each fused op off where the op table switches off one of its parts."""

import pytest
import torch

from glm_lightning.generation import sampling_weights
from glm_lightning.model import GLMConfig, GLMModel, cext
from glm_lightning.model.ops import backend, block_decode, decode

pytestmark = pytest.mark.skipif(not cext.available(), reason="C++ ops disabled (GLM_LIGHTNING_EXT=0) or not buildable")

FUSED = ("kda_block", "dsa_block", "moe_half")
ALL = decode.OPS


def _spy(monkeypatch) -> list[tuple[str, bool]]:
    """Record (entry, ran as one op) for every call of the two block entries inside a decode step."""
    ran: list[tuple[str, bool]] = []
    for name in FUSED:
        real = getattr(block_decode, name)

        def spy(*args, _real=real, _name=name):
            out = _real(*args)
            if decode._on:  # not a prefill
                ran.append((_name, out is not None))
            return out

        monkeypatch.setattr(block_decode, name, spy)
    return ran


def _steps(model: GLMModel, fused: bool, monkeypatch, rows: int = 3, steps: int = 4,
           pad_row: int | None = None) -> list[torch.Tensor]:
    """Logits of a prefill and `steps` decode steps (``pad_row``: that row a padding token from the second step on, as
    generation feeds a finished row), then the cache's state tensors."""
    monkeypatch.setattr(decode, "OPS", tuple(op for op in ALL if fused or op not in FUSED))
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (rows, 12), generator=gen)
    out = []
    with torch.inference_mode():
        cache = model.new_cache(rows)
        out.append(model(prompt, cache=cache).logits)
        for step in range(steps):
            valid = None
            if pad_row is not None and step > 0:
                valid = torch.ones(rows, 1, dtype=torch.bool)
                valid[pad_row] = False
            out.append(model(out[-1][:, -1:].argmax(-1), valid=valid, cache=cache).logits)
    return out + [t for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]


def _model(precision: str = "32", **overrides) -> GLMModel:
    torch.manual_seed(0)
    # 12 + 1 > 4 keys: sparse decode, masked below 4 x 4 keys (thresholds.DECODE_GATHER_MIN_KEYS_PER_TOP_K)
    cfg = GLMConfig.preset("tiny", **{"layer_pattern": "LLS", "index_top_k": 4, **overrides})
    return sampling_weights(GLMModel(cfg).eval(), precision)


def _per_step(model: GLMModel, kda_whole: bool = True, dsa_whole: bool = True) -> list[tuple[str, bool]]:
    """The block entries' calls of one decode step: a block as one op (``kda_whole``, ``dsa_whole``), else its mixer
    by its ops and its MoE half as one op."""
    kda = [("kda_block", True)] if kda_whole else [("kda_block", False), ("moe_half", True)]
    dsa = [("dsa_block", True)] if dsa_whole else [("dsa_block", False), ("moe_half", True)]
    return [c for kind in model.cfg.layer_kinds for c in (kda if kind == "L" else dsa)]


def _assert_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("precision", ["32", "bf16"])
@pytest.mark.parametrize("shared", [True, False])
def test_block_ops_equal_the_ops_one_by_one(monkeypatch, precision, shared):
    model = _model(precision, **({} if shared else {"shared_expert_hidden": 0}))
    ran = _spy(monkeypatch)
    fused = _steps(model, True, monkeypatch)
    # each decode step's blocks, not the prefill's; the DSA block at 13-15 keys (> top-k 4), its gathered form at 16
    assert ran == _per_step(model) * 3 + _per_step(model, dsa_whole=False)
    ran.clear()
    general = _steps(model, False, monkeypatch)
    assert ran and not any(done for _, done in ran)
    _assert_equal(fused, general)


def test_padding_rows(monkeypatch):
    """Padded steps (a finished row: an identity step of its KDA state, its DSA key masked) run each block as one op
    too: the same values as the ops one by one."""
    model = _model()
    ran = _spy(monkeypatch)
    fused = _steps(model, True, monkeypatch, pad_row=1)
    assert ran == _per_step(model) * 3 + _per_step(model, dsa_whole=False)  # 16 keys: DSA's gathered form
    _assert_equal(fused, _steps(model, False, monkeypatch, pad_row=1))


def test_padding_rows_without_the_padded_kda_ops(monkeypatch):
    """With the op table switching off an op of KDA's padded path (kda_features), padded steps run KDA's mixer by its
    ops (then the MoE half as one op); unpadded steps keep the KDA block op (its core is another op)."""
    model = _model()
    ran = _spy(monkeypatch)
    with backend.cpp_ops_off(("kda_features",)):
        fused = _steps(model, True, monkeypatch, pad_row=1)
        padded = _per_step(model, kda_whole=False)
        assert ran == _per_step(model) + padded * 2 + _per_step(model, kda_whole=False, dsa_whole=False)
        _assert_equal(fused, _steps(model, False, monkeypatch, pad_row=1))


@pytest.mark.parametrize("pad_row", [None, 1])
def test_dsa_dense_bypass_as_one_op(monkeypatch, pad_row):
    """While the cache holds at most top-k keys (DSA's dense bypass: every allowed key, no indexer query) the DSA block
    runs as one op too, with padding rows (a query without keys attends its own slot, as fill_empty_rows): the same
    values as the ops one by one."""
    model = _model(index_top_k=16)
    ran = _spy(monkeypatch)
    fused = _steps(model, True, monkeypatch, pad_row=pad_row)
    assert ran == _per_step(model) * 4  # 13-16 keys <= 16
    _assert_equal(fused, _steps(model, False, monkeypatch, pad_row=pad_row))


def test_dsa_block_with_the_pytorch_attention_form(monkeypatch):
    """With the op table choosing single_query_attention's PyTorch form, the DSA block op runs it (the same ATen
    calls): the same values as the ops one by one under that table."""
    model = _model()
    ran = _spy(monkeypatch)
    with backend.cpp_ops_off(("single_query_attention",)):
        fused = _steps(model, True, monkeypatch)
        assert ran == _per_step(model) * 3 + _per_step(model, dsa_whole=False)
        _assert_equal(fused, _steps(model, False, monkeypatch))


BLOCK_OPS = ("kda_block", "kda_block_pads", "dsa_block", "moe_half")


@pytest.mark.parametrize("part, off", [
    *((p, BLOCK_OPS) for p in ("site_read", "rms_norm", "stream_write", "swiglu", "moe_route")),
    ("kda_decode_step", ("kda_block", "kda_block_pads")), ("kda_delta_step", ("kda_block_pads",)),
    ("gated_head_norm", ("kda_block_pads",)), ("index_scores", ("dsa_block",)), ("topk_mask", ("dsa_block",)),
    ("single_query_attention", ())])  # the DSA block op runs either attention form
def test_block_ops_off_without_their_parts(part, off):
    """The op table switching off one op a block op calls switches the block op off (its values are that path's)."""
    with backend.cpp_ops_off((part,)), decode.fp32_step(True):
        assert [op for op in BLOCK_OPS if not decode.cpp(op)] == [op for op in BLOCK_OPS if op in off]
    with decode.fp32_step(True):
        assert all(decode.cpp(op) for op in BLOCK_OPS)


@pytest.mark.parametrize("entry, off", [("moe_decode", FUSED), ("site_read", FUSED), ("rotary", ("dsa_block",)),
                                        ("linear", ("kda_block", "dsa_block")), ("kda_decode_step", ("kda_block",))])
def test_block_ops_off_when_an_entry_they_call_is_off(monkeypatch, entry, off):
    """Without a decode entry a block op calls (bench_decode_forms' earlier forms) that block op does not run."""
    monkeypatch.setattr(decode, "OPS", tuple(op for op in ALL if op != entry))
    with decode.fp32_step(True):
        assert [op for op in FUSED if not decode.cpp(op)] == [op for op in FUSED if op in off]


def test_fallback_with_a_part_off_equals_the_ops_one_by_one(monkeypatch):
    """With the op table switching off stream_write's C++ form, the blocks run by their modules (PyTorch stream write),
    the same values as the path without the block ops."""
    model = _model()
    ran = _spy(monkeypatch)
    with backend.cpp_ops_off(("stream_write",)):
        off = _steps(model, True, monkeypatch)
        assert ran and not any(done for _, done in ran)
        _assert_equal(off, _steps(model, False, monkeypatch))


def test_dense_ffn_and_one_stream_fall_back(monkeypatch):
    """A dense FFN (no MoE) or one stream (no site parameters): the block ops do not take the block; same values."""
    for overrides in ({"ffn": "dense"}, {"hc_streams": 1}):
        model = _model(**overrides)
        ran = _spy(monkeypatch)
        fused = _steps(model, True, monkeypatch)
        assert ran and not any(done for _, done in ran)
        _assert_equal(fused, _steps(model, False, monkeypatch))
        monkeypatch.undo()


def test_the_tune_records_the_decode_steps_ops_one_by_one():
    """The op-choice tune times each op on its recorded calls: its decode step runs the blocks by their ops (the block
    ops' kernels are those ops'), so the decode-only ops are recorded, at the decode step's 16 rows."""
    from glm_lightning.model.ops import recorded_calls

    calls = recorded_calls.record("tiny")
    assert calls.get("kda_decode_step") and calls.get("decode_attention")
    site_reads = [c for c in calls["site_read"] if not c.grad]
    assert site_reads and site_reads[-1].args[0].shape[:2] == (16, 1)
    assert decode.OPS == ALL
