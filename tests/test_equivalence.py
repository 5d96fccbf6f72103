"""Provenance (issue 47): committed runs keep the identity they ran with; an edited config counts them only through
an explicit, checked equivalence record, which the findings table shows; a rewritten identity is refused."""

import subprocess
from pathlib import Path

import pytest
import yaml

from glm_lightning.sweep.equivalence import EquivalenceError
from glm_lightning.sweep.findings import EXPERIMENTS, from_saved, main
from glm_lightning.sweep.study import StudyError, load_study

REPO = Path(__file__).resolve().parents[1]
SCREEN = EXPERIMENTS / "rl_screen_tutorial.yaml"
DATA = REPO / "docs" / "results" / "data" / "rl_screen_tutorial.json"


def _git_show(spec: str) -> str:
    return subprocess.run(["git", "show", spec], cwd=REPO, capture_output=True, text=True, check=True).stdout


def test_committed_screen_runs_count_through_the_checked_record(tmp_path):
    study = load_study(SCREEN)
    found = from_saved(study, DATA, tmp_path / "runs")
    assert found.finished == 144 and found.stale == 0 and found.rewritten == 0
    (record, pairs), = found.equivalent.items()
    assert len(pairs) == 144 and record.ran_at == "331ce38"
    assert all(old != new for old, new in pairs)  # identities as run, not the current config's


def test_a_rewritten_identity_is_refused(tmp_path):
    """01d5095 rewrote the 144 identities to the current base config while their fingerprint parts still record
    the text they ran under: that copy must not count."""
    rewritten = tmp_path / "rl_screen_tutorial.json"
    rewritten.write_text(_git_show("01d5095:docs/results/data/rl_screen_tutorial.json"))
    found = from_saved(load_study(SCREEN), rewritten, tmp_path / "runs")
    assert found.finished == 0 and found.rewritten == 144


def _screen_with(tmp_path: Path, **record_changes) -> Path:
    raw = yaml.safe_load(SCREEN.read_text())
    raw["base"] = str(EXPERIMENTS / raw["base"])
    raw["equivalences"] = [{**raw["equivalences"][0], **record_changes}]
    path = tmp_path / "rl_screen_tutorial.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_a_record_must_name_exactly_the_edit(tmp_path):
    study = load_study(_screen_with(tmp_path, added=["start_cache: somewhere/else"]))
    with pytest.raises(EquivalenceError, match="not the lines the record lists"):
        from_saved(study, DATA, tmp_path / "runs")


def test_a_record_from_another_text_covers_no_run(tmp_path):
    """A record whose old text is not the one the runs recorded (here: the current text itself) accepts nothing."""
    study = load_study(_screen_with(tmp_path, ran_at="HEAD", added=[]))
    found = from_saved(study, DATA, tmp_path / "runs")
    assert found.finished == 0 and found.stale == 144


def test_a_record_needs_a_reason_and_a_rerun(tmp_path):
    with pytest.raises(StudyError, match="reason and the rerun"):
        load_study(_screen_with(tmp_path, rerun=" "))


def test_the_findings_row_and_notes_show_the_record(tmp_path):
    out = main(["--studies", str(SCREEN), "--runs", str(tmp_path / "runs"), "--data", str(DATA.parent),
                "--out", str(tmp_path / "F.md")], log=lambda _m: None).read_text()
    rows = [line for line in out.splitlines() if line.startswith("| 1 |")]
    assert rows and "144 of them count through an equivalence record" in rows[0]
    assert "runs made at other code than now (git 331ce38)" in rows[0]
    assert "identities are never rewritten" in out and "the rerun that matched: 852c75b" in out
