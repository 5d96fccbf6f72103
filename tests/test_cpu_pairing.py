"""CPU (issue 47): a study refuses to pair runs made on different CPUs with a one-line error naming them, and the
findings row names the CPU its runs recorded (or says it was not recorded)."""

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from glm_lightning.sweep.analysis import analyse, study_cpus
from glm_lightning.sweep.findings import StudyResults, code_note
from glm_lightning.sweep.runner import RunResult, plan_runs
from glm_lightning.sweep.study import StudyError, load_study

TINY = Path(__file__).parent / "conf" / "sweep_tiny.yaml"


def _results(tmp_path: Path, cpu_of) -> tuple:  # noqa: ANN001
    raw = yaml.safe_load(TINY.read_text())
    raw.update(base=str((TINY.parent / raw["base"]).resolve()), seeds=6)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    study = load_study(path)
    out = []
    for i, spec in enumerate(plan_runs(study, tmp_path / "runs")):
        parts = {**spec.parts, "environment": {**spec.parts["environment"], "cpu": cpu_of(spec)}}
        out.append(RunResult(replace(spec, parts=parts), "done",
                             {"val/completion_acc": 0.5 + 0.01 * i, "val/loss": 1.0}, wall_s=1.0))
    return study, out


def test_runs_of_one_cpu_are_paired_and_the_row_names_it(tmp_path):
    study, results = _results(tmp_path, lambda spec: "AMD EPYC 9R14 [AVX512]")
    assert analyse(study, results)[0].comparisons[0].n == 6
    assert study_cpus(results) == ["AMD EPYC 9R14 [AVX512]"]
    assert "; CPU AMD EPYC 9R14 [AVX512]" in code_note(StudyResults(study, results))


def test_pairing_runs_of_two_cpus_is_refused_in_one_line(tmp_path):
    study, results = _results(tmp_path, lambda spec: "Intel Xeon [AVX512]" if spec.variant == "interleaved"
                              and spec.seed == 3 else "AMD EPYC 9R14 [AVX512]")
    with pytest.raises(StudyError) as err:
        analyse(study, results)
    message = str(err.value)
    assert "\n" not in message and "seed 3" in message and "Intel Xeon [AVX512]" in message


def test_a_row_of_unrecorded_runs_says_so(tmp_path):
    study, results = _results(tmp_path, lambda spec: None)
    study.cpu = "a 2-core AVX-512 CPU (its report)"
    assert "CPU not recorded per run (the study states: a 2-core AVX-512 CPU (its report))" in code_note(
        StudyResults(study, results))
