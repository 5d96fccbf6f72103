import os

import torch

from glm_lightning import threads


def test_idle_cores_decide(monkeypatch):
    monkeypatch.setattr(threads, "busy_cores", lambda: 0.0)
    assert threads.choose_threads(cores=8) == 8


def test_busy_cores_are_not_used(monkeypatch):
    monkeypatch.setattr(threads, "busy_cores", lambda: 1.2)
    assert threads.choose_threads(cores=2) == 1
    monkeypatch.setattr(threads, "busy_cores", lambda: 5.0)
    assert threads.choose_threads(cores=2) == 1  # never below one
    monkeypatch.setattr(threads, "busy_cores", lambda: 0.3)
    assert threads.choose_threads(cores=4) == 4


def test_use_threads_sets_torch():
    before = torch.get_num_threads()
    try:
        assert threads.use_threads(threads=1) == 1 and torch.get_num_threads() == 1
        assert threads.use_threads(threads=2) == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_stage_cli_chooses_threads_unless_the_user_fixed_them(monkeypatch):
    from glm_lightning.stage_cli import choose_run_threads

    monkeypatch.setattr(threads, "busy_cores", lambda: 0.0)
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert choose_run_threads() == 2 and torch.get_num_threads() == 2, "idle 2 cores: both"
    monkeypatch.setattr(threads, "busy_cores", lambda: 1.2)
    assert choose_run_threads() == 1, "one core already busy"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert choose_run_threads() is None and torch.get_num_threads() == 1, "the user's OMP_NUM_THREADS wins"


def test_busy_cores_come_from_cpu_time_not_the_lagging_load_average(monkeypatch):
    # two samples of (busy, total) CPU time: 2 CPUs, 100 ticks in the window, 50 of them busy -> one core's worth
    assert threads.busy_between((1000.0, 5000.0), (1050.0, 5100.0), cpus=2) == 1.0
    assert threads.busy_between((1000.0, 5000.0), (1000.0, 5100.0), cpus=2) == 0.0
    assert threads.busy_between((1000.0, 5000.0), (1000.0, 5000.0), cpus=2) == 0.0, "no time passed: unknown = 0"
    samples = iter([(1000.0, 5000.0), (1100.0, 5100.0)])  # everything busy
    monkeypatch.setattr(threads, "_cpu_times", lambda: next(samples))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # the lagging figure disagrees: not used
    assert threads.busy_cores(window_s=0.0) == 2.0

    def unreadable():
        raise OSError("no /proc")
    monkeypatch.setattr(threads, "_cpu_times", unreadable)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 0.0, 0.0))
    assert threads.busy_cores(window_s=0.0) == 1.5, "fallback: the load average"
