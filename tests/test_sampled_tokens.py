"""The same seed samples the same tokens as the tree that recorded benchmarks/sampled_tokens.json (a refactor of the
model or a new fast form must not change them). The tiny preset's three sampling modes here (cheap); all nine cases
with `python -m benchmarks.sampled_tokens --check benchmarks/sampled_tokens.json`. The file holds the tokens of one
CPU and torch version, with the C++ ops: elsewhere float rounding may differ, so the test says so and skips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import sampled_tokens
from glm_lightning.model import cext

RECORDED = Path(__file__).resolve().parent.parent / "benchmarks" / "sampled_tokens.json"


@pytest.mark.parametrize("mode", sorted(sampled_tokens.MODES))
def test_tiny_preset_samples_the_recorded_tokens(mode):
    recorded = json.loads(RECORDED.read_text())
    if recorded["machine"] != sampled_tokens.machine():
        pytest.skip(f"tokens recorded on another machine ({recorded['machine']})")
    if not cext.available():
        pytest.skip("tokens recorded with the C++ ops, which are not built here")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokens = sampled_tokens.sample("tiny", mode)
    finally:
        torch.set_num_threads(threads)
    assert tokens == recorded["cases"][f"tiny/{mode}"]
