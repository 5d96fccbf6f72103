"""Sweeps end to end: a 2 variants x 2 seeds study of 3-step tiny runs (real subprocesses) produces REPORT.md, charts
and hparams; re-running launches nothing; bad study files, unknown config keys, zero seeds and unknown metrics fail
with clear errors; a failing run is reported while the other runs go on, and the exit status is non-zero."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from glm_lightning.sweep import StudyError, load_study, main, run_sweep, validate_config
from glm_lightning.sweep.runner import RunResult, check_metrics, execute, plan_runs, read_done

CONF = Path(__file__).parent / "conf"
STUDY = CONF / "sweep_tiny.yaml"
BASE = (CONF / "sweep_base_tiny.yaml").resolve()
RUNS = [(v, s) for s in (0, 1) for v in ("blocked", "interleaved")]


def _quiet(_msg: str) -> None:
    pass


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweeps")
    outcome = run_sweep(["--config", str(STUDY), "--out", str(out), "--workers", "2"], log=_quiet)
    return outcome, out


def _write_study(path: Path, **changes) -> Path:
    raw = yaml.safe_load(STUDY.read_text())
    raw["base"] = str(BASE)
    raw["name"] = "sweep_tiny"  # same output directory as the fixture's study, so its finished runs are reused
    raw.update(changes)
    raw = {k: v for k, v in raw.items() if v is not None}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _copy_runs(out: Path, dest: Path) -> Path:
    shutil.copytree(out / "sweep_tiny", dest / "sweep_tiny")
    return dest


def _done(out: Path, variant: str, seed: int) -> dict:
    return json.loads((out / "sweep_tiny" / variant / f"seed{seed}" / "DONE.json").read_text())


# --- the tiny sweep ------------------------------------------------------------------------------------------------
def test_sweep_runs_every_variant_and_seed_and_writes_report(tiny_sweep):
    outcome, out = tiny_sweep
    assert [r.status for r in outcome.results] == ["done"] * 4 and not outcome.failed
    study_dir = out / "sweep_tiny"
    acc = {}
    for variant, seed in RUNS:
        run_dir = study_dir / variant / f"seed{seed}"
        done = _done(out, variant, seed)
        assert list(run_dir.glob("events.out.tfevents.*")), "events must be written directly into the run dir"
        assert f"--seed_everything={seed}" in done["command"] and f"--data.init_args.seed={seed}" in done["command"]
        assert f"--data.init_args.ordering={variant}" in done["command"]
        assert 0.0 <= done["final"]["val/completion_acc"] <= 1.0 and np.isfinite(done["final"]["val/loss"])
        acc[variant, seed] = done["final"]["val/completion_acc"]

    report = (study_dir / "REPORT.md").read_text()
    blocked = np.mean([acc["blocked", s] for s in (0, 1)]) * 100
    diff = np.mean([acc["interleaved", s] - acc["blocked", s] for s in (0, 1)]) * 100
    assert f"| **blocked** (control) | 2 | {blocked:.1f} |" in report
    row = next(line for line in report.splitlines() if line.startswith("| interleaved | 2 |"))
    assert f"| {diff:+.1f} |" in row and "n=2 seeds" in row
    assert "smallest attainable p is 0.50" in row  # 2 seeds can never be significant: the verdict says so
    assert "## Secondary metric: `val/loss`" in report
    assert f"python -m glm_lightning sweep --config {STUDY}" in report or "sweep_tiny.yaml --seeds 2" in report
    assert "interleaved beat blocked by ~10 points" in report  # the tutorial's numbers from the study file

    for chart in ("sweep_tiny-curves.png", "sweep_tiny-paired.png"):
        data = (study_dir / chart).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
        assert f"]({chart})" in report


def test_results_file_saves_every_finished_run(tiny_sweep):
    """results.json (what `sweep findings` reads and commits) holds each run's fingerprint and final metrics."""
    from glm_lightning.sweep.fingerprint import git_revision

    outcome, out = tiny_sweep
    saved = json.loads((out / "sweep_tiny" / "results.json").read_text())
    assert saved["study"] == "sweep_tiny" and saved["workers"] == 2 and saved["ran_now"] == 4
    assert saved["elapsed_s"] > 0 and "sweep_tiny.yaml" in saved["command"]
    sweep = json.loads((out / "sweep_tiny" / "SWEEP.json").read_text())  # what --report-only reads back
    assert sweep["seeds"] == 2 and sweep["settings"] == [] and sweep["config"] == str(STUDY)
    by_key = {(r["variant"], r["seed"]): r for r in saved["runs"]}
    assert set(by_key) == set(RUNS)
    for variant, seed in RUNS:
        done = _done(out, variant, seed)
        assert by_key[variant, seed]["fingerprint"] == done["fingerprint"]
        assert set(done["parts"]) == {"arguments", "configs", "checkpoints", "source", "environment"}
        assert done["git"] == git_revision() == by_key[variant, seed]["git"]  # the commit each run ran at
        assert by_key[variant, seed]["final"] == {t: done["final"][t] for t in ("val/completion_acc", "val/loss")}


def test_hparams_view_has_one_entry_per_run(tiny_sweep):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out = tiny_sweep
    for variant, seed in RUNS:
        run = out / "sweep_tiny" / "hparams" / variant / f"seed{seed}"
        acc = EventAccumulator(str(run), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        assert acc.PluginTagToContent("hparams")  # the HPARAMS tab's session info
        final = acc.Scalars("final/val/completion_acc")[-1].value
        assert final == pytest.approx(_done(out, variant, seed)["final"]["val/completion_acc"])


def test_rerun_skips_finished_runs(tiny_sweep):
    first, out = tiny_sweep
    report = out / "sweep_tiny" / "REPORT.md"
    mtimes = {r: (out / "sweep_tiny" / r[0] / f"seed{r[1]}" / "DONE.json").stat().st_mtime_ns for r in RUNS}
    events = sorted(p.name for p in (out / "sweep_tiny").rglob("events.out.tfevents.*") if "hparams" not in str(p))
    outcome = run_sweep(["--config", str(STUDY), "--out", str(out), "--workers", "2"], log=_quiet)
    assert outcome.launched == 0 and [r.status for r in outcome.results] == ["skipped"] * 4
    assert {r: (out / "sweep_tiny" / r[0] / f"seed{r[1]}" / "DONE.json").stat().st_mtime_ns for r in RUNS} == mtimes
    assert sorted(p.name for p in (out / "sweep_tiny").rglob("events.out.tfevents.*")
                  if "hparams" not in str(p)) == events
    assert "4 finished (0 in this invocation, 4 reused)" in report.read_text()
    # a run whose definition changed (another fingerprint) is not reused
    spec = plan_runs(load_study(STUDY), out)[0]
    assert read_done(spec) is not None
    spec.fingerprint = "something-else"
    assert read_done(spec) is None


def test_fingerprint_ignores_where_the_checkout_lies(tmp_path):
    """The same base text in two places gives the same run fingerprints (a moved or second checkout reuses finished
    runs and committed results); other base text gives others."""
    studies = []
    for name in ("a", "b"):
        d = tmp_path / name
        d.mkdir()
        shutil.copy(BASE, d / "base.yaml")
        studies.append(_write_study(d / "study.yaml", base="base.yaml"))
    a, b = load_study(studies[0]), load_study(studies[1])
    assert a.base != b.base
    assert [a.fingerprint(v, 0) for v in a.variants] == [b.fingerprint(v, 0) for v in b.variants]
    (tmp_path / "b" / "base.yaml").write_text(BASE.read_text() + "\n# edited\n")
    changed = load_study(studies[1])
    assert all(a.fingerprint(v, 0) != changed.fingerprint(w, 0) for v, w in zip(a.variants, changed.variants))


def test_dry_run_prints_commands_and_runs_nothing(tmp_path, capsys):
    run_sweep(["--config", str(STUDY), "--out", str(tmp_path), "--dry-run", "--seeds", "3"])
    text = capsys.readouterr().out
    assert not (tmp_path / "sweep_tiny").exists()
    assert text.count("[todo]") == 6 and "OMP_NUM_THREADS=1" in text
    assert "--seed_everything=2 --data.init_args.seed=2" in text
    assert f"--trainer.logger.init_args.save_dir={tmp_path / 'sweep_tiny' / 'interleaved' / 'seed2'}" in text


# --- bad inputs ----------------------------------------------------------------------------------------------------
def test_variable_that_is_not_a_config_field_is_named(tmp_path):
    study = load_study(_write_study(tmp_path / "s.yaml", variable="data.init_args.orderng"))
    with pytest.raises(StudyError, match=r"offending key\(s\): data\.init_args\.orderng.*'orderng' is not accepted"):
        validate_config(study)
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(tmp_path / "s.yaml"), "--out", str(tmp_path), "--dry-run"])
    assert exc.value.code == 2


def test_bad_override_value_fails_before_running(tmp_path):
    study = load_study(_write_study(tmp_path / "s.yaml", values=["blocked", "sideways"]))
    with pytest.raises(StudyError, match=r"variant 'sideways'.*unknown ordering 'sideways'"):
        validate_config(study)


@pytest.mark.parametrize("seeds, message", [(0, "at least 1 seed"), ([], "empty list"), ("ten", "count or a list"),
                                            ([1, 1], "duplicate seeds")])
def test_bad_seeds(tmp_path, seeds, message):
    with pytest.raises(StudyError, match=message):
        load_study(_write_study(tmp_path / "s.yaml", seeds=seeds))


def test_seed_count_from_the_command_line(tmp_path):
    path = _write_study(tmp_path / "s.yaml", seeds=[11, 22])
    assert load_study(path, seeds=4).seeds == [11, 22, 23, 24]
    assert load_study(path, seeds=1).seeds == [11]
    with pytest.raises(StudyError, match="--seeds must be >= 1"):
        load_study(path, seeds=0)


@pytest.mark.parametrize("text, message", [
    ("base: [unclosed\n", "not valid YAML"),
    ("- just\n- a list\n", "must be a YAML mapping"),
    (None, "unknown key"),
    (None, "control 'random' is not one of the variants"),
    (None, "base config 'nowhere.yaml' not found"),
    (None, "at least 2 values"),
    (None, "exactly one of `values`"),
    (None, "metrics\\[0\\] must be a tag string"),
])
def test_bad_study_files(tmp_path, text, message):
    path = tmp_path / "s.yaml"
    if text is not None:
        path.write_text(text)
    elif message.startswith("unknown"):
        _write_study(path, overides={"trainer.max_steps": 2})
    elif message.startswith("control"):
        _write_study(path, control="random")
    elif message.startswith("base"):
        _write_study(path)
        path.write_text(path.read_text().replace(str(BASE), "nowhere.yaml"))
    elif message.startswith("at least"):
        _write_study(path, values=["blocked"])
    elif message.startswith("exactly"):
        _write_study(path, variants={"a": {"trainer.max_steps": 1}, "b": {"trainer.max_steps": 2}})
    else:
        _write_study(path, metrics=[{"name": "val/loss"}])
    with pytest.raises(StudyError, match=message):
        load_study(path)
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(path), "--dry-run"])
    assert exc.value.code == 2


def test_unknown_metric_fails_clearly(tiny_sweep, tmp_path, capsys):
    _, out = tiny_sweep
    dest = _copy_runs(out, tmp_path / "out")
    path = _write_study(tmp_path / "s.yaml", metrics=["val/completion_accuracy"])
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(path), "--out", str(dest), "--workers", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "metric(s) ['val/completion_accuracy'] were not logged" in err and "'val/completion_acc'" in err


def test_unknown_metric_is_checked_after_the_first_finished_run(tmp_path):
    """execute() stops at the first finished run that lacks a metric (fake backend: no subprocess)."""
    from torch.utils.tensorboard import SummaryWriter

    study = load_study(_write_study(tmp_path / "s.yaml", metrics=["val/missing"]))
    specs = plan_runs(study, tmp_path / "out")
    seen = []

    class FakeBackend:
        def run(self, specs, on_outcome):
            for spec in specs:
                spec.run_dir.mkdir(parents=True)
                with SummaryWriter(str(spec.run_dir)) as w:
                    w.add_scalar("val/loss", 1.0, 3)
                seen.append(spec.key)
                on_outcome((spec, 0, 0.1))

    with pytest.raises(StudyError, match=r"\['val/missing'\] were not logged by run blocked/seed0.*'val/loss'"):
        execute(study, specs, FakeBackend(), log=_quiet)
    assert seen == ["blocked/seed0"]
    with pytest.raises(StudyError):
        check_metrics(study, RunResult(specs[1], "done", {"val/loss": 1.0}))


def test_failing_run_is_reported_others_continue_exit_nonzero(tiny_sweep, tmp_path, capsys):
    _, out = tiny_sweep
    dest = _copy_runs(out, tmp_path / "out")
    redo = dest / "sweep_tiny" / "interleaved" / "seed0" / "DONE.json"
    redo.unlink()  # a healthy run that has to run next to the broken one
    variants = {"broken": {"data.init_args.ordering": "interleaved", "trainer.accelerator": "no_such_accelerator"},
                "blocked": {"data.init_args.ordering": "blocked"},
                "interleaved": {"data.init_args.ordering": "interleaved"}}
    path = _write_study(tmp_path / "s.yaml", values=None, variants=variants)
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(path), "--out", str(dest), "--workers", "2", "--seeds", "1"])
    assert exc.value.code == 1
    assert "1 of 3 runs failed or did not run: broken/seed0" in capsys.readouterr().err
    failed = json.loads((dest / "sweep_tiny" / "broken" / "seed0" / "FAILED.json").read_text())
    assert failed["returncode"] != 0 and "no_such_accelerator" in failed["error"]
    assert not (dest / "sweep_tiny" / "broken" / "seed0" / "DONE.json").exists()
    assert redo.is_file()  # the healthy run finished despite the failure
    report = (dest / "sweep_tiny" / "REPORT.md").read_text()
    assert "## Failed runs" in report and "`broken/seed0`" in report and "no_such_accelerator" in report
    assert re.search(r"\| interleaved \| 1 \| \d+\.\d \|", report)  # the healthy variants are still compared
    assert "not testable: 0 paired seeds" in report


def test_make_test_installs_ray_so_ci_runs_the_ray_test():
    """`make test` (what CI runs) installs the `ray` extra, so test_ray_backend runs there instead of skipping."""
    import tomllib

    from glm_lightning.sweep.study import REPO_ROOT

    install = [ln for ln in (REPO_ROOT / "Makefile").read_text().splitlines() if "pip install" in ln and "-e" in ln]
    assert install and "ray" in install[0].split("-e", 1)[1]
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("ray") for dep in extras["ray"])


def test_ray_backend(tmp_path):
    ray = pytest.importorskip("ray")
    outcome = run_sweep(["--config", str(STUDY), "--out", str(tmp_path), "--workers", "2", "--seeds", "1",
                         "--backend", "ray"], log=_quiet)
    assert [r.status for r in outcome.results] == ["done", "done"]
    assert (tmp_path / "sweep_tiny" / "REPORT.md").is_file()
    assert not ray.is_initialized()  # the local Ray the sweep started is shut down with it (no processes left)


# --- stopping, resuming, settings for every run ----------------------------------------------------------------------
def test_set_overrides_a_key_for_every_run(tmp_path, capsys):
    run_sweep(["--config", str(STUDY), "--out", str(tmp_path), "--dry-run", "--set", "trainer.max_steps=7",
               "--set", "model.init_args.lr=0.001"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[todo]")]
    assert len(lines) == 4 and all("--trainer.max_steps=7" in ln and "--model.init_args.lr=0.001" in ln for ln in lines)


@pytest.mark.parametrize("setting, message", [("trainer.max_steps", "KEY=VALUE"),
                                              ("data.init_args.ordering=blocked", "varies"),
                                              ("trainer.max_stepz=3", "max_stepz")])
def test_bad_settings_fail_before_running(tmp_path, setting, message):
    with pytest.raises(Exception, match=message):
        run_sweep(["--config", str(STUDY), "--out", str(tmp_path), "--set", setting], log=_quiet)
    assert not (tmp_path / "sweep_tiny").exists()


def test_n_boot_is_deprecated_with_a_message(tmp_path):
    said = []
    run_sweep(["--config", str(STUDY), "--out", str(tmp_path), "--dry-run", "--n-boot", "100"], log=said.append)
    assert any("--n-boot is ignored" in line for line in said)


def test_a_finished_run_of_other_settings_is_moved_aside_not_deleted(tiny_sweep, tmp_path):
    from glm_lightning.sweep.runner import prepare_run_dir

    _, out = tiny_sweep
    dest = _copy_runs(out, tmp_path)
    spec = plan_runs(load_study(STUDY).with_settings({"trainer.max_steps": 4}), dest)[0]
    done = (spec.run_dir / "DONE.json").read_text()
    assert prepare_run_dir(spec, log=_quiet) == []
    aside = spec.run_dir.with_name(spec.run_dir.name + ".old-1")
    assert (aside / "DONE.json").read_text() == done and (spec.run_dir / "RUN.json").is_file()


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_stopping_the_driver_stops_its_runs_and_a_rerun_resumes(tmp_path):
    """SIGTERM to the driver while its second run trains: that run saves last.ckpt and stops, the finished run is
    untouched, and the same command resumes the stopped run from its checkpoint."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from glm_lightning.sweep.runner import run_env

    args = ["--config", str(STUDY), "--out", str(tmp_path), "--workers", "1", "--seeds", "1",
            "--set", "trainer.max_steps=200", "--set", "trainer.enable_checkpointing=true",
            "--set", "last_checkpoint.every_n_train_steps=10", "--set", "trainer.val_check_interval=200"]
    driver = subprocess.Popen([sys.executable, "-m", "glm_lightning", "sweep", *args], env=run_env(1),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first, second = (tmp_path / "sweep_tiny" / v / "seed0" for v in ("blocked", "interleaved"))
    deadline = time.monotonic() + 300
    # wait (bounded) until the first run is done and the second has trained a few steps
    while not ((first / "DONE.json").is_file() and (second / "checkpoints" / "last.ckpt").is_file()):
        assert driver.poll() is None and time.monotonic() < deadline, driver.stderr.read().decode()[-2000:]
        time.sleep(0.2)
    runs = _children(driver.pid)
    assert runs, "the second run is a child of the driver"
    done_before = (first / "DONE.json").read_text()
    driver.send_signal(signal.SIGTERM)
    assert driver.wait(timeout=120) == 130
    assert not [pid for pid in runs if Path(f"/proc/{pid}").exists()], "the driver's runs stopped with it"
    assert (first / "DONE.json").read_text() == done_before and not (second / "DONE.json").exists()
    stopped_at = torch_load_step(second / "checkpoints" / "last.ckpt")
    assert 0 < stopped_at < 200
    # the same command resumes the stopped run from its checkpoint
    outcome = run_sweep(args, log=_quiet)
    assert [r.status for r in outcome.results] == ["skipped", "done"]
    assert "--ckpt_path" in (second / "command.txt").read_text().splitlines()[-1]
    assert (first / "DONE.json").read_text() == done_before
    assert torch_load_step(second / "checkpoints" / "last.ckpt") == 200


def torch_load_step(path: Path) -> int:
    import torch

    return int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])



def test_ray_dry_run_without_ray_says_ray_is_missing(tmp_path, monkeypatch):
    """A dry run of the ray backend checks that Ray imports: without it, the one-line install hint, not "config OK"."""
    import builtins

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    lines = []
    with pytest.raises(StudyError, match=r"the ray backend needs Ray: pip install"):
        run_sweep(["--config", str(STUDY), "--out", str(tmp_path), "--backend", "ray", "--dry-run"], log=lines.append)
    assert not any("config OK" in ln for ln in lines)
