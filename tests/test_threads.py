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


def test_stage_cli_chooses_threads_unless_the_user_fixed_them(monkeypatch):
    from types import SimpleNamespace

    from glm_lightning.stage_cli import choose_run_threads

    wide = SimpleNamespace(glm_config=GLMConfig.preset("flash-25m"))
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert choose_run_threads(wide) == 2 and torch.get_num_threads() == 2, "idle 2 cores, a wide model: both"
    assert choose_run_threads(SimpleNamespace(glm_config=GLMConfig.preset("tiny"))) == 1 == torch.get_num_threads()
    monkeypatch.setattr(os, "getloadavg", lambda: (1.2, 0.0, 0.0))
    assert choose_run_threads(wide) == 1, "one core already busy"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert choose_run_threads(wide) is None and torch.get_num_threads() == 1, "the user's OMP_NUM_THREADS wins"
    assert choose_run_threads(SimpleNamespace()) is None
