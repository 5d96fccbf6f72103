"""benchmarks/bench_decode_forms.py keeps each earlier form of the decode step as a patch: each patch must still take
effect (a form that silently ran the current code would report a speed-up of 1.0x for nothing)."""

from __future__ import annotations

import pytest

from benchmarks import bench_decode_forms
from glm_lightning.model import cext

pytestmark = pytest.mark.skipif(not cext.available(), reason="the decode forms compare C++ entries")


def test_every_earlier_form_dispatches_more_ops_than_the_current_step():
    res = bench_decode_forms.run(rounds=1, rows=2, prompt_len=8)
    assert set(res) == set(bench_decode_forms.FORMS)
    current, blocks = res["current"]["ops"], res["blocks: ops one by one"]["ops"]
    assert current < blocks  # the block ops dispatch fewer ATen ops than the blocks' modules
    for name, r in res.items():
        assert r["ms"] > 0 and r["min_ms"] <= r["ms"]
        if name == "linear: checks per call":  # the same ATen ops as the blocks by their modules, more Python
            assert r["ops"] == blocks
        elif name not in ("current", "blocks: ops one by one"):  # each earlier form patches the blocks' modules
            assert r["ops"] > blocks, (name, r["ops"], blocks)
    assert res["all of the above (f645ffb)"]["ops"] == max(r["ops"] for r in res.values())


def test_a_padded_step_runs_the_block_ops_too():
    """With a padding row (a finished row) the current step still dispatches fewer ATen ops than the blocks' modules."""
    res = bench_decode_forms.run(rounds=1, rows=2, prompt_len=8, padded=1)
    assert res["current"]["ops"] < res["blocks: ops one by one"]["ops"]
