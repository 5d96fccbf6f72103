"""The twins benchmark swaps each PyTorch twin for its reference form: every swap must reach the code the model runs
(a swap patched where the model no longer looks the name up times the unchanged model and reports noise)."""

from unittest import mock

import pytest
import torch

from benchmarks.bench_twins import SWAPS, step, swapped
from glm_lightning.model import GLMConfig, GLMModel


@pytest.mark.parametrize("name", sorted(n for n in SWAPS if SWAPS[n]))
def test_every_swap_is_called_by_a_training_step(name):
    torch.manual_seed(0)
    model = GLMModel(GLMConfig.preset("tiny"))
    ids = torch.randint(0, 256, (2, 17))
    calls = []
    with swapped(name):
        for target, attr, _ in SWAPS[name]:
            replacement = getattr(target, attr)

            def counting(*args, _f=replacement, **kwargs):
                calls.append(attr)
                return _f(*args, **kwargs)

            with mock.patch.object(target, attr, counting):
                step(model, ids)
    assert calls, f"{name}: the swapped function was never called"
