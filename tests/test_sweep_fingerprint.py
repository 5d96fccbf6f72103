"""A sweep never mixes runs made from different inputs (issue 31, part 3), and `--report-only` finds the runs of the
sweep that wrote the folder or refuses without touching REPORT.md (issue 35, section 1).

The finished runs here are written by hand (DONE.json as the runner writes it), so no training runs: after a change
of each of the four fingerprint parts (arguments, config text of a stacked config, a checkpoint the run loads, the
package source) the run either runs again (other arguments) or the sweep refuses with a message naming what
changed; --accept-old-runs takes them, --rerun-changed runs them again."""

import argparse
import json
import shutil
from pathlib import Path

import pytest
import yaml

from glm_lightning.sweep import StudyError, load_study, run_sweep
from glm_lightning.sweep import fingerprint as fp
from glm_lightning.sweep.cli import SWEEP_FILE, record_arguments
from glm_lightning.sweep.runner import DONE_FILE, plan_runs, read_done, stale_runs

CONF = Path(__file__).parent / "conf"
STUDY = CONF / "sweep_tiny.yaml"
BASE = (CONF / "sweep_base_tiny.yaml").resolve()


def _quiet(_msg: str) -> None:
    pass


@pytest.fixture(autouse=True)
def _no_config_validation(monkeypatch):
    """The runs' bookkeeping only: parsing the configs (tests/test_sweep.py) would load the stand-in checkpoint."""
    import glm_lightning.sweep.cli as cli

    monkeypatch.setattr(cli, "validate_config", lambda study, log_args=(): None)


@pytest.fixture
def study_file(tmp_path: Path) -> Path:
    """The tiny study with a stacked config (`--config=overlay.yaml` after the base) and a checkpoint it loads
    (`model.init_args.init_weights`; a stand-in file: only its digest matters here)."""
    (tmp_path / "overlay.yaml").write_text("trainer:\n  max_steps: 3\n")
    (tmp_path / "start.ckpt").write_bytes(b"weights v1")
    raw = yaml.safe_load(STUDY.read_text())
    raw.update(base=str(BASE), name="sweep_tiny",
               overrides={**raw["overrides"], "config": str(tmp_path / "overlay.yaml"),
                          "model.init_args.init_weights": str(tmp_path / "start.ckpt")})
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _finish(study, out: Path, git: str | None = None) -> None:
    """Write DONE.json for every run as `runner.finalize` does (fingerprint, parts, identity, final metrics, and the
    commit when `git` is given; runs recorded before runs kept their commit have none)."""
    for i, spec in enumerate(plan_runs(study, out)):
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        done = {"variant": spec.variant, "seed": spec.seed, "fingerprint": spec.fingerprint, "parts": spec.parts,
                "identity": spec.identity, "final": {"val/completion_acc": 0.5 + 0.01 * i, "val/loss": 1.0},
                "steps": {}, "wall_s": 1.0, **({"git": git} if git else {})}
        (spec.run_dir / DONE_FILE).write_text(json.dumps(done))


def test_parts_cover_arguments_stacked_configs_checkpoints_and_source(study_file, tmp_path):
    study = load_study(study_file)
    parts = study.fingerprint_parts(study.variants[0], 0)
    assert set(parts) == {"arguments", "configs", "checkpoints", "source", "environment"}
    assert set(parts["environment"]) == {"torch", "lightning", "cpu"}
    assert set(parts["configs"]) == {"tests/conf/sweep_base_tiny.yaml", "overlay.yaml"}
    assert parts["checkpoints"] == {str(tmp_path / "start.ckpt"): fp.file_digest(tmp_path / "start.ckpt")[:16]}
    assert parts["source"] == fp.source_digest() and len(fp.source_files()) > 50
    (tmp_path / "start.ckpt").unlink()
    assert load_study(study_file).fingerprint_parts(study.variants[0], 0)["checkpoints"] == {
        str(tmp_path / "start.ckpt"): "missing"}


def test_a_config_named_inside_a_config_is_covered(tmp_path):
    (tmp_path / "inner.yaml").write_text("lr: 0.1\n")
    (tmp_path / "outer.yaml").write_text("model: inner.yaml\nweights: w.pt\n")
    (tmp_path / "w.pt").write_bytes(b"x")
    configs, checkpoints = fp.referenced_files(["--config", str(tmp_path / "outer.yaml")])
    assert {p.name for p in configs.values()} == {"outer.yaml", "inner.yaml"}
    assert checkpoints == {"w.pt": tmp_path / "w.pt"}


def test_other_arguments_run_again(study_file, tmp_path, capsys):
    out = tmp_path / "out"
    _finish(load_study(study_file), out)
    changed = load_study(study_file).with_settings({"trainer.max_steps": 4})
    specs = plan_runs(changed, out)
    assert stale_runs(specs) == [] and all(read_done(s) is None for s in specs)  # another run: not reused
    run_sweep(["--config", str(study_file), "--out", str(out), "--dry-run", "--set", "trainer.max_steps=4"])
    text = capsys.readouterr().out
    assert text.count("[todo]") == 4 and "[stale" not in text


@pytest.mark.parametrize("change, named", [
    ("config", "config overlay.yaml"),
    ("checkpoint", "checkpoint "),
    ("source", "the package source"),
    ("torch", "torch (2.0.0 -> "),
    ("cpu", "cpu (Some Other CPU [AVX2] -> "),
])
def test_changed_inputs_make_the_sweep_refuse_naming_them(study_file, tmp_path, monkeypatch, change, named):
    out = tmp_path / "out"
    _finish(load_study(study_file), out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    if change == "config":
        (tmp_path / "overlay.yaml").write_text("trainer:\n  max_steps: 3  # edited\n")
    elif change == "checkpoint":
        (tmp_path / "start.ckpt").write_bytes(b"weights v2")
    elif change in ("torch", "cpu"):  # the finished runs were made with another torch / on another CPU
        old = {"torch": "2.0.0", "cpu": "Some Other CPU [AVX2]"}[change]
        for done_file in out.rglob(DONE_FILE):
            done = json.loads(done_file.read_text())
            done["parts"]["environment"][change] = old
            done["fingerprint"] = fp.combine(done["parts"])
            done_file.write_text(json.dumps(done))
        before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    else:
        monkeypatch.setattr(fp, "source_digest", lambda root=fp.REPO_ROOT: "0123456789abcdef")
    with pytest.raises(StudyError) as err:
        run_sweep(["--config", str(study_file), "--out", str(out), "--workers", "1"], log=_quiet)
    message = str(err.value)
    assert "\n" not in message and "4 finished run(s)" in message and named in message
    assert "--accept-old-runs" in message and "--rerun-changed" in message
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing launched or moved
    if change == "checkpoint":
        assert str(tmp_path / "start.ckpt") in message


def test_accept_old_runs_reuses_them_and_keeps_their_fingerprint(study_file, tmp_path, monkeypatch):
    out = tmp_path / "out"
    study = load_study(study_file)
    _finish(study, out)
    old = {s.key: s.fingerprint for s in plan_runs(study, out)}
    monkeypatch.setattr(fp, "source_digest", lambda root=fp.REPO_ROOT: "0123456789abcdef")
    said = []
    outcome = run_sweep(["--config", str(study_file), "--out", str(out), "--workers", "1", "--accept-old-runs"],
                        log=said.append)
    assert [r.status for r in outcome.results] == ["skipped"] * 4
    assert any("reusing 4 run(s) made from other inputs: the package source" in line for line in said)
    saved = json.loads((out / "sweep_tiny" / "results.json").read_text())
    assert {f"{r['variant']}/seed{r['seed']}": r["fingerprint"] for r in saved["runs"]} == old


@pytest.mark.parametrize("recorded", ["abc1234", None])
def test_reused_runs_report_the_commit_they_recorded_not_the_one_checked_out_now(study_file, tmp_path, recorded):
    """Issue 31, part 4: `--report-only` (and reused runs) name the commit each run recorded when it finished, or
    say that it recorded none; the checked-out commit is only the report's own."""
    out = tmp_path / "out"
    _finish(load_study(study_file), out, git=recorded)
    run_sweep(["--config", str(study_file), "--out", str(out), "--report-only"], log=_quiet)
    report = (out / "sweep_tiny" / "REPORT.md").read_text()
    saved = json.loads((out / "sweep_tiny" / "results.json").read_text())
    code = next(line for line in report.splitlines() if line.startswith("- code:"))
    if recorded:
        assert "runs at git abc1234 (4 runs)" in code and saved["git"] == "abc1234"
        assert [r["git"] for r in saved["runs"]] == ["abc1234"] * 4
    else:
        assert "4 run(s) recorded no commit" in code and "the runs recorded no commit" in saved["git"]
    assert "report written" in code


def test_rerun_changed_runs_them_again(study_file, tmp_path, monkeypatch):
    import glm_lightning.sweep.cli as cli

    out = tmp_path / "out"
    _finish(load_study(study_file), out)
    (tmp_path / "start.ckpt").write_bytes(b"weights v2")
    launched = []

    class Recording:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def run(self, specs, on_outcome) -> None:
            launched.extend(s.key for s in specs)

    monkeypatch.setattr(cli, "LocalBackend", Recording)
    run_sweep(["--config", str(study_file), "--out", str(out), "--workers", "1", "--rerun-changed"], log=_quiet)
    assert sorted(launched) == sorted(s.key for s in plan_runs(load_study(study_file), out))


def test_runs_recorded_before_fingerprints_had_parts_are_stale_not_reused(study_file, tmp_path):
    out = tmp_path / "out"
    study = load_study(study_file)
    for spec in plan_runs(study, out):
        spec.run_dir.mkdir(parents=True)
        (spec.run_dir / DONE_FILE).write_text(json.dumps({"fingerprint": spec.identity, "final": {}}))
    specs = plan_runs(study, out)
    assert all(read_done(s) is None for s in specs) and all(read_done(s, accept_old=True) for s in specs)
    assert all("predates" in what[0] for _, what in stale_runs(specs))


# --- --report-only (issue 35) ----------------------------------------------------------------------------------------
def _recorded_sweep(tmp_path: Path) -> tuple[Path, Path]:
    """Finished runs of a sweep that ran with --seeds 3 --set trainer.max_steps=4, and its SWEEP.json."""
    out = tmp_path / "out"
    study = load_study(STUDY).with_seed_count(3).with_settings({"trainer.max_steps": 4})
    _finish(study, out)
    args = argparse.Namespace(config=str(STUDY), settings=["trainer.max_steps=4"], threads_per_run=1)
    record_arguments(out / "sweep_tiny", args, study)
    return out, out / "sweep_tiny"


def test_report_only_finds_the_runs_of_the_sweep_that_wrote_the_folder(tmp_path):
    out, folder = _recorded_sweep(tmp_path)
    outcome = run_sweep(["--config", str(STUDY), "--out", str(out), "--report-only"], log=_quiet)
    assert [r.status for r in outcome.results] == ["skipped"] * 6
    report = (folder / "REPORT.md").read_text()
    assert "6 finished" in report and "--seeds 3" in report and "--set trainer.max_steps=4" in report


def test_report_only_without_matching_runs_refuses_and_leaves_the_report(tmp_path, capsys):
    from glm_lightning.sweep.cli import main

    out, folder = _recorded_sweep(tmp_path)
    (folder / "REPORT.md").write_text("# the committed report\n")
    before = (folder / "REPORT.md").read_bytes()
    with pytest.raises(SystemExit) as exit_:  # other settings than the recorded sweep's: none of its runs
        main(["--config", str(STUDY), "--out", str(out), "--report-only", "--set", "trainer.max_steps=5"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no finished run of this sweep" in err and "left as it was" in err
    (folder / SWEEP_FILE).unlink()  # a folder of an older sweep: it names what to give
    with pytest.raises(SystemExit):
        main(["--config", str(STUDY), "--out", str(out), "--report-only"])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "records no sweep arguments" in err
    assert (folder / "REPORT.md").read_bytes() == before
    assert not (folder / "results.json").exists()


def test_rl_table_without_runs_refuses_and_leaves_the_committed_report(tmp_path):
    import subprocess
    import sys

    from glm_lightning.sweep.runner import run_env
    from glm_lightning.sweep.study import REPO_ROOT

    committed = REPO_ROOT / "docs" / "results" / "rl_tutorial_size.md"
    copy = tmp_path / "rl_tutorial_size.md"
    shutil.copy(committed, copy)
    proc = subprocess.run([sys.executable, "-m", "glm_lightning.sweep.rl_table", "--out", str(tmp_path / "none"),
                           "--report", str(copy)], cwd=REPO_ROOT, env=run_env(1), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rl_table: error: no finished run") and "left as it was" in lines[0]
    assert copy.read_bytes() == committed.read_bytes()


def test_weights_a_run_loaded_outside_its_fingerprint_are_checked_at_reuse(study_file, tmp_path):
    """Issue 47: a checkpoint loaded through a code default is named by no argument or config file, so the fingerprint
    cannot cover it; the run's own record (hparams.yaml `loaded_weights`, copied into DONE.json) does."""
    from glm_lightning.sweep.runner import loaded_weights

    out = tmp_path / "out"
    study = load_study(study_file)
    _finish(study, out)
    hidden = tmp_path / "default_start.ckpt"
    hidden.write_bytes(b"hidden v1")
    spec = plan_runs(study, out)[0]
    (spec.run_dir / "version_0").mkdir()
    (spec.run_dir / "version_0" / "hparams.yaml").write_text(yaml.safe_dump({"loaded_weights": {str(hidden): fp.file_digest(hidden)[:16]}}))
    recorded = loaded_weights(spec.run_dir)
    done = json.loads((spec.run_dir / DONE_FILE).read_text())
    (spec.run_dir / DONE_FILE).write_text(json.dumps({**done, "loaded_weights": recorded}))
    assert read_done(spec) is not None  # unchanged: reused
    hidden.write_bytes(b"hidden v2")
    assert read_done(spec) is None and read_done(spec, accept_old=True) is not None
    [(stale, what)] = stale_runs(plan_runs(study, out))
    assert stale.key == spec.key and "default_start.ckpt" in what[0] and "then" in what[0]


def test_a_stage_records_the_digest_of_the_weights_it_loads(tmp_path):
    import torch

    from glm_lightning.model import GLMConfig, GLMModel
    from glm_lightning.modules.rl import RLModule
    from glm_lightning.run_record import weights_digest

    tiny = {"preset": "tiny", "model_overrides": {"max_seq_len": 192}}
    src = GLMModel(GLMConfig.preset("tiny", max_seq_len=192))
    ckpt = tmp_path / "start.ckpt"
    torch.save({"glm_config": src.cfg.to_dict(), "state_dict": {f"model.{k}": v for k, v in src.state_dict().items()}}, ckpt)
    module = RLModule(**tiny, init_weights=str(ckpt))
    assert module.hparams["loaded_weights"] == {str(ckpt): weights_digest(ckpt)}
    assert len(weights_digest(ckpt)) == 16 and weights_digest(ckpt) == fp.file_digest(ckpt)[:16]
