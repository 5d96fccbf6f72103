"""`make bench` never replaces its results file with less than it held: `--only X` merges into the saved rows, a
failed or unknown benchmark leaves the file byte for byte; bench_vs_commit without git history is one line; the
profiler prints no GPU errors on a machine without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import benchmarks.__main__ as bench
from benchmarks.bench_vs_commit import export

ROOT = Path(__file__).resolve().parent.parent
SAVED = {"ops": {"study": {"total": 2274}, "threads": 1}, "kda": {"available": True, "study": {"speedup": 4.0}}}


@pytest.fixture
def saved(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "results" / "latest.json"
    path.parent.mkdir()
    path.write_text(json.dumps(SAVED, indent=2))
    monkeypatch.setattr(bench, "RESULTS", path)
    monkeypatch.setattr(bench, "choose_threads", lambda: 1)
    return path


def test_only_one_benchmark_merges_into_the_saved_rows(saved, monkeypatch):
    fresh = {"available": True, "study": {"speedup": 5.0}}
    monkeypatch.setattr(bench, "run_benches", lambda names, quick, threads: ({"kda": fresh}, []))
    monkeypatch.setattr(bench, "summary_rows", lambda results: [])
    bench.main(["--only", "kda", "--threads", "1"])
    now = json.loads(saved.read_text())
    assert now["ops"] == SAVED["ops"] and now["kda"] == fresh


@pytest.mark.parametrize("argv, outcome", [
    (["--only", "kda"], "benchmarks failed: ['kda']"),
    (["--only", "nosuch"], "choose from ops,cext"),
    (["--only", ""], "choose from ops,cext"),
])
def test_a_failed_or_unknown_benchmark_leaves_the_file_byte_for_byte(saved, monkeypatch, argv, outcome):
    before = saved.read_bytes()
    monkeypatch.setattr(bench, "run_benches", lambda names, quick, threads: ({}, list(names)))
    with pytest.raises(SystemExit, match=outcome.replace("[", r"\[").replace("]", r"\]")):
        bench.main([*argv, "--threads", "1"])
    assert saved.read_bytes() == before


def test_an_unreadable_results_file_is_refused_before_anything_runs(saved, monkeypatch):
    saved.write_text("{not json")
    monkeypatch.setattr(bench, "run_benches", lambda *a: pytest.fail("ran benchmarks"))
    with pytest.raises(SystemExit, match="is not readable JSON"):
        bench.main(["--only", "kda"])
    assert saved.read_text() == "{not json"


def test_bench_vs_commit_without_git_history_is_one_line(tmp_path):
    with pytest.raises(SystemExit) as err:
        export("11d912b", tmp_path / "out", root=tmp_path)
    message = str(err.value.code)
    assert message.startswith("error: bench_vs_commit needs the git history") and "\n" not in message


def test_the_profiler_prints_no_gpu_errors_on_a_cpu_machine():
    code = ("import benchmarks, torch\n"
            "from torch.profiler import ProfilerActivity, profile\n"
            "with profile(activities=[ProfilerActivity.CPU]):\n"
            "    torch.ones(3) + 1\n"
            "print('cuda', torch.cuda.is_available())\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    if "cuda True" in done.stdout:
        pytest.skip("a GPU machine: Kineto's GPU messages are its own business there")
    assert "gpuGetDeviceCount" not in done.stderr and "USDT" not in done.stderr, done.stderr
