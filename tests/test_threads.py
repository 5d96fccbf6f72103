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


def test_stage_cli_threads_default_to_the_machines_cores_not_the_load(monkeypatch):
    from glm_lightning.stage_cli import choose_run_threads

    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "busy_cores", lambda: 1.2)
    assert choose_run_threads() == 2 and torch.get_num_threads() == 2, "the default does not depend on the load"
    assert choose_run_threads("auto") == 1, "auto: one core already busy"
    monkeypatch.setattr(threads, "busy_cores", lambda: 0.0)
    assert choose_run_threads("auto") == 2, "auto: idle 2 cores: both"
    assert choose_run_threads(1) == 1 and torch.get_num_threads() == 1, "--threads N fixes it"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_run_threads() == 3, "the sweep's OMP_NUM_THREADS is the default when set"
    assert choose_run_threads(2) == 2, "--threads wins over OMP_NUM_THREADS"


def test_bad_thread_counts_are_one_line_errors(monkeypatch):
    for bad in (0, -2, "two"):
        try:
            threads.resolve_threads(bad)
        except ValueError as err:
            assert "--threads" in str(err)
        else:
            raise AssertionError(f"{bad!r} accepted")
    monkeypatch.setenv("OMP_NUM_THREADS", "x")
    try:
        threads.resolve_threads(None)
    except ValueError as err:
        assert "OMP_NUM_THREADS" in str(err)
    else:
        raise AssertionError("OMP_NUM_THREADS=x accepted")


def test_busy_warning_only_when_the_cores_are_taken(monkeypatch):
    monkeypatch.setattr(threads, "busy_cores", lambda: 0.2)
    assert threads.busy_warning(2, cores=2) is None
    monkeypatch.setattr(threads, "busy_cores", lambda: 1.5)
    assert "--threads 1" in threads.busy_warning(2, cores=2)
    assert threads.busy_warning(1, cores=2) is None


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
