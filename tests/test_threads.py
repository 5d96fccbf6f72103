import os

import torch

from glm_lightning.model import GLMConfig
from glm_lightning.model import threads


def test_small_models_run_single_threaded(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert threads.choose_threads(GLMConfig.preset("tiny"), cores=8) == 1
    assert threads.choose_threads(GLMConfig.preset("flash-25m"), cores=8) == 8


def test_busy_cores_are_not_used(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (1.2, 0.0, 0.0))
    assert threads.choose_threads(GLMConfig.preset("flash-25m"), cores=2) == 1
    monkeypatch.setattr(os, "getloadavg", lambda: (5.0, 0.0, 0.0))
    assert threads.choose_threads(None, cores=2) == 1  # never below one
    monkeypatch.setattr(os, "getloadavg", lambda: (0.3, 0.0, 0.0))
    assert threads.choose_threads(None, cores=4) == 4


def test_use_threads_sets_torch():
    before = torch.get_num_threads()
    try:
        assert threads.use_threads(threads=1) == 1 and torch.get_num_threads() == 1
        assert threads.use_threads(GLMConfig.preset("tiny")) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
