"""The op-choice table (glm_lightning/model/ops/choice.py): its defaults, the margin rule that keeps noise from flipping
a choice, the thresholds it derives, its cache file (key, invalidation, a corrupt file), the pin to the shipped
defaults, and what a run records. Timings come from a fake timer: nothing here measures speed (the benchmark
`python -m benchmarks --only op_choice` does)."""

from __future__ import annotations

import json

import pytest
import torch

from glm_lightning import machine
from glm_lightning.model import cext
from glm_lightning.model.ops import backend, choice, thresholds


@pytest.fixture
def clean(tmp_path, monkeypatch):
    """A cache of its own, the table unpinned, and the process's table, thresholds and backend state restored."""
    monkeypatch.setenv("GLM_LIGHTNING_CACHE", str(tmp_path))
    monkeypatch.delenv(choice.ENV, raising=False)
    saved = ({n: getattr(thresholds, n) for n in choice.TUNED_THRESHOLDS}, backend._cpp_off, dict(choice._tables),
             choice._active, choice._logged)
    choice.forget()
    yield tmp_path
    for name, value in saved[0].items():
        setattr(thresholds, name, value)
    backend.set_cpp_off(saved[1])
    choice._tables.clear()
    choice._tables.update(saved[2])
    choice._active, choice._logged = saved[3], saved[4]


def _measured(**changes) -> choice.Table:
    ref = choice.defaults()
    cpp = {**ref.cpp, **{k: v for k, v in changes.items() if k in ref.cpp}}
    limits = {**ref.thresholds, **{k: v for k, v in changes.items() if k in ref.thresholds}}
    return choice.Table(cpp=cpp, thresholds=limits, source="measured", speedups={"rms_norm": 1.3})


def test_defaults_are_every_cpp_op_on_and_the_shipped_thresholds():
    table = choice.defaults()
    assert set(table.cpp) == set(choice.CPP_OPS) and all(table.cpp.values())
    assert table.thresholds == {n: thresholds.DEFAULTS[n] for n in choice.TUNED_THRESHOLDS}
    assert table.changes() == {} and table.source == "defaults"


@pytest.mark.parametrize("default_s, other_s, flips", [
    ([1.0] * 5, [0.90] * 5, True),  # 11% faster in every round
    ([1.0] * 5, [0.92] * 5, False),  # 8.7%: within the margin, the default stays
    ([1.0] * 5, [0.5, 0.5, 1.0, 1.0, 1.0], False),  # much faster, but in 2 rounds of 5
    ([1.0] * 5, [0.5, 0.5, 0.5, 1.2, 1.2], False),  # 3 of 5: a bare majority is not enough
    ([1.0] * 5, [0.5, 0.5, 0.5, 0.5, 1.2], True),  # 4 of 5
    ([1.0] * 3, [0.5, 0.5, 1.0], True),  # 2 of 3
    ([1.0] * 4, [0.5, 0.5, 1.0, 1.0], False),  # half
    ([1.0] * 3, [2.0] * 3, False),  # slower
])
def test_the_other_form_wins_only_by_the_margin_in_two_thirds_of_the_rounds(default_s, other_s, flips):
    assert choice.decide(default_s, other_s) is flips


class FakeClock:
    """A timer that a form's call advances by its scripted cost (plus `spike` once, a preemption)."""

    def __init__(self, costs: dict[str, float]):
        self.now, self.costs, self.calls, self.spike = 0.0, costs, [], {}

    def __call__(self) -> float:
        return self.now

    def form(self, name: str):
        def run():
            self.now += self.costs[name] + self.spike.pop(len(self.calls), 0.0)
            self.calls.append(name)
        return run


def test_time_pair_alternates_the_forms_and_a_preempted_block_does_not_count():
    clock = FakeClock({"a": 2e-3, "b": 1e-3})
    clock.spike[4 + 3] = 1.0  # the first timed block of b (after 4 warm-up calls and a block of 3 a's): preempted
    ta, tb = choice.time_pair(clock.form("a"), clock.form("b"), rounds=4, min_block_s=0.004, blocks=2, timer=clock)
    assert ta == pytest.approx([2e-3] * 4) and tb == pytest.approx([1e-3] * 4)
    # warm-up a b a b; blocks of 3 a's and 5 b's (>= 4 ms each), two of each per round, the first form alternating
    round_a_first, round_b_first = ["a"] * 3 + ["b"] * 5, ["b"] * 5 + ["a"] * 3
    assert clock.calls == ["a", "b", "a", "b"] + 2 * (2 * round_a_first + 2 * round_b_first)


@pytest.mark.parametrize("small, default, inclusive, expected", [
    ({1: True, 4: True, 16: True, 32: True, 64: False}, 32, True, 32),  # as shipped
    ({1: False, 4: False, 16: False, 32: False, 64: False}, 32, True, 0),  # BLAS everywhere
    ({1: True, 4: True, 16: False, 32: False, 64: False}, 32, True, 4),
    ({1: True, 4: True, 16: True, 32: True, 64: True}, 32, True, 64),
    ({1: True, 4: False, 16: True, 32: True, 64: False}, 32, True, 1),  # the small form's run ends at the first loss
    ({1: True, 2: True, 4: False, 8: False}, 4, False, 4),  # mask below 4 x top_k, gather from there: as shipped
    ({1: True, 2: False, 4: False, 8: False}, 4, False, 2),
    ({1: False, 2: False, 4: False, 8: False}, 4, False, 1),  # gather from 1 x top_k
    ({1: True, 2: True, 4: True, 8: True}, 4, False, 9),
])
def test_threshold_from_the_forms_chosen_per_size(small, default, inclusive, expected):
    assert choice.threshold_from(sorted(small), small, default, inclusive) == expected


def test_the_cache_key_changes_with_threads_torch_library_and_cpu(clean, monkeypatch):
    base = choice.cache_path(1)
    assert base.parent == clean / "ops" and base.suffix == ".json"
    assert choice.cache_path(2) != base
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert choice.cache_path(1) != base
    monkeypatch.undo()
    monkeypatch.setenv("GLM_LIGHTNING_CACHE", str(clean))
    monkeypatch.delenv(choice.ENV, raising=False)
    monkeypatch.setattr(choice, "library_tag", lambda: "0123456789abcdef")
    assert choice.cache_path(1) != base
    monkeypatch.setattr(cext, "_cpu_model", lambda: "model name\t: Some Other CPU 7")
    assert "Some-Other-CPU-7" in choice.cache_path(1).name


def test_the_library_tag_follows_the_sources(clean, monkeypatch):
    monkeypatch.setenv("GLM_LIGHTNING_EXT", "1")
    tag = choice.library_tag()
    assert tag in cext.library_path().name
    monkeypatch.setattr(cext, "library_path", lambda: clean / "ext" / "glm_lightning_ops_feedfacefeedface.so")
    assert choice.library_tag() == "feedfacefeedface"
    monkeypatch.setenv("GLM_LIGHTNING_EXT", "0")
    assert choice.library_tag() == "noext"


def test_a_saved_table_is_loaded_and_applied_to_the_thresholds_and_the_backend(clean, monkeypatch, capsys):
    table = _measured(rms_norm=False, SMALL_ROWS=0)
    path = choice.save(table, threads=1)
    assert path == choice.cache_path(1)
    loaded = choice.load(1)
    assert loaded.source == "measured" and loaded.digest() == table.digest()
    assert loaded.changes() == {"rms_norm": "PyTorch", "SMALL_ROWS": 0}
    applied = choice.apply(1)
    assert applied.digest() == table.digest() and choice.active() is applied
    assert thresholds.SMALL_ROWS == 0 and backend._cpp_off == frozenset({"rms_norm"})
    monkeypatch.setattr(cext, "available", lambda: True)
    x = torch.ones(2, 3)
    assert not backend.takes(x, op="rms_norm") and backend.takes(x, op="swiglu") and backend.takes(x)
    line = capsys.readouterr().err.strip().splitlines()
    assert len(line) == 1 and line[0].startswith("[ops] measured on ") and "rms_norm -> PyTorch (1.30x)" in line[0]
    choice.apply(1)  # once per process
    assert capsys.readouterr().err == ""
    assert choice.load(2).source == "defaults"  # another thread count: not measured


def test_the_env_switch_pins_the_shipped_defaults(clean, monkeypatch, capsys):
    choice.save(_measured(rms_norm=False, SMALL_ROWS=0), threads=1)
    monkeypatch.setenv(choice.ENV, "defaults")
    table = choice.apply(1)
    assert table.source == "pinned" and table.digest() == choice.defaults().digest()
    assert thresholds.SMALL_ROWS == thresholds.DEFAULTS["SMALL_ROWS"] and backend._cpp_off == frozenset()
    assert capsys.readouterr().err == ""  # pinned on purpose: nothing to say


@pytest.mark.parametrize("text", ["{not json", json.dumps([1, 2]), json.dumps({"cpp": {"rms_norm": "yes"},
                                                                               "thresholds": {}}),
                                  json.dumps({"cpp": {}, "thresholds": {"SMALL_ROWS": -3}})])
def test_a_corrupt_cache_file_is_ignored_with_one_line(clean, capsys, text):
    path = choice.cache_path(1)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    table = choice.load(1)
    assert table.digest() == choice.defaults().digest() and table.source == "defaults"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[ops] ignoring the op table") and str(path) in err[0]


def test_unknown_names_are_ignored_and_missing_ones_take_defaults(clean):
    path = choice.cache_path(1)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"cpp": {"rms_norm": False, "an_op_since_removed": False},
                                "thresholds": {"SMALL_TOKENS": 16}}))
    table = choice.load(1)
    assert table.changes() == {"rms_norm": "PyTorch", "SMALL_TOKENS": 16}


def test_a_run_records_the_table_it_ran_with(clean):
    choice.save(_measured(swiglu=False), threads=1)
    choice.apply(1)
    info = machine.machine_info()
    assert info["op_table"] == {"digest": choice.active().digest(), "source": "measured",
                                "changes": {"swiglu": "PyTorch"}}
    assert machine.describe(info).endswith(f", op table {choice.active().digest()} (measured)")
    choice.forget()
    choice.apply(2)  # nothing measured at 2 threads
    assert machine.machine_info()["op_table"]["source"] == "defaults"


def test_every_op_in_the_table_is_asked_for_by_name_in_the_ops():
    """Each name of choice.CPP_OPS is passed to backend.takes by some decision point (a typo would leave the table's
    entry without effect)."""
    from pathlib import Path

    src = "".join(p.read_text() for p in (Path(choice.__file__).parent).glob("*.py") if p.name != "choice.py")
    for op in choice.CPP_OPS:
        assert f'"{op}"' in src, op


def test_one_thread_is_timed_in_cpu_time_more_in_wall_time():
    """Other processes on a shared machine do not inflate this thread's CPU time; with more threads the others' work
    is not this thread's, so the wall time."""
    import time

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert choice.clock() is time.thread_time
        torch.set_num_threads(2)
        assert choice.clock() is time.perf_counter
    finally:
        torch.set_num_threads(before)


def test_the_tune_replays_every_recorded_op_in_both_forms_and_applies_the_rule(monkeypatch):
    """tune.measure on the tiny preset's recorded calls with a fake timing where the default form is always 1.5x
    slower: each form of each row runs (the replays work in both forms), and every entry flips to the other form (a
    threshold to the edge the flipped sizes give); ops the preset never calls keep their defaults."""
    from glm_lightning.model.ops import tune

    calls = tune.record("tiny")
    ran = []

    def fake_pair(first, second, rounds=choice.ROUNDS, **_):
        first()
        second()
        ran.append(rounds)
        return [1.5] * rounds, [1.0] * rounds

    monkeypatch.setattr(choice, "time_pair", fake_pair)
    table, rows = tune.measure(calls, rounds=3, say=lambda line: None)
    ops_rows = [r for r in rows if r.size is None]
    assert ran == [3] * len(rows) and all(r.flipped for r in rows)
    if not cext.available():
        assert not ops_rows and table.cpp == choice.defaults().cpp
    else:
        assert {r.key for r in ops_rows} == {op for op in choice.CPP_OPS if calls.get(op)}
        assert {op for op, on in table.cpp.items() if not on} == {r.key for r in ops_rows}
        assert table.thresholds["SMALL_ROWS"] == 0  # BLAS at 1 row: the small form's run is empty
        assert table.thresholds["SMALL_TOKENS"] == 0
    sizes = {r.key for r in rows if r.size is not None}
    if "DECODE_GATHER_MIN_KEYS_PER_TOP_K" in sizes:  # gather at 1 x top_k: the mask's run is empty
        assert table.thresholds["DECODE_GATHER_MIN_KEYS_PER_TOP_K"] == 1
