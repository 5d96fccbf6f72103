"""Pre-training stage through the CLI: fast_dev_run per ordering/corpus, a real short run with TensorBoard events and
checkpoints, and resuming continues the step count."""

from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from glm_lightning.cli import main
from glm_lightning.modules.base import read_checkpoint

CONF = str(Path(__file__).parent / "conf" / "pretrain_tiny.yaml")


@pytest.mark.parametrize("corpus, ordering", [
    ("functions", "interleaved"), ("functions", "blocked"), ("functions", "curriculum"),
    ("composition", "interleaved"), ("composition", "blocked"), ("composition", "curriculum"),
])
def test_fast_dev_run(tmp_path, corpus, ordering):
    args = ["fit", "--config", CONF, "--trainer.fast_dev_run", "2", "--trainer.default_root_dir", str(tmp_path),
            "--data.init_args.corpus", corpus, "--data.init_args.ordering", ordering]
    if corpus == "composition":
        args += ["--data.init_args.families", "null"]
    if ordering == "curriculum":
        args += ["--data.init_args.curriculum", '[{"fraction": 0.5, "diversity": 2}, {"fraction": 0.5}]']
    main(args)


def _scalars(log_dir: Path) -> dict[str, list[float]]:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}, acc


def test_real_run_logs_checkpoints_and_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    common = ["--config", CONF, "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"),
              "--trainer.val_check_interval", "2", "--trainer.callbacks+=ModelCheckpoint",
              "--trainer.callbacks.save_last=true", "--trainer.callbacks.dirpath", str(tmp_path / "ckpt")]
    main(["fit", *common, "--trainer.max_steps", "4"])
    run_dir = tmp_path / "logs" / "test" / "version_0"
    scalars, acc = _scalars(run_dir)
    for tag in ("train/loss", "val/loss", "val/bpb", "val/completion_acc", "val/dev_pass", "train/tokens_per_s",
                "val/families_solved", "val/families_majority", "time/train_minutes"):
        assert tag in scalars, sorted(scalars)
    families = [t for t in scalars if t.startswith("val/dev_pass/")]
    for i, (solved, majority) in enumerate(zip(scalars["val/families_solved"], scalars["val/families_majority"])):
        rates = [scalars[t][i] for t in families]
        assert solved == sum(r == 1.0 for r in rates) and majority == sum(r > 0.5 for r in rates)
    assert len(scalars["time/train_minutes"]) == 2 and 0 < scalars["time/train_minutes"][0] < scalars[
        "time/train_minutes"][1]
    assert all(torch.isfinite(torch.tensor(v)).all() for v in scalars.values())
    assert any(t.startswith("samples/dev") for t in acc.Tags()["tensors"])
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.is_file()
    assert torch.load(last, weights_only=False)["global_step"] == 4
    cfg, state, _ = read_checkpoint(last)
    assert cfg.d_model == 32 and "embed.weight" in state

    state = torch.load(last, weights_only=False)
    assert state["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"batches_served": 4}]

    main(["fit", *common, "--trainer.max_steps", "6", "--ckpt_path", str(last)])
    resumed = torch.load(last, weights_only=False)
    assert resumed["global_step"] == 6
    minutes, _ = _scalars(run_dir.parent / "version_1")  # the checkpoint lives outside the log dir: a new version
    assert minutes["time/train_minutes"][-1] > scalars["time/train_minutes"][-1], "the fit clock continues on resume"
    assert resumed["train_seconds"] > state["train_seconds"] > 0
    assert resumed["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"batches_served": 6}]


def test_print_config_shows_full_config(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", CONF, "--print_config"])
    out = capsys.readouterr().out
    assert "PretrainModule" in out and "dev_max_new_tokens" in out and "ordering: interleaved" in out


def test_bad_data_config_fails_before_training(tmp_path):
    with pytest.raises(ValueError, match="unknown ordering"):
        main(["fit", "--config", CONF, "--trainer.fast_dev_run", "1", "--data.init_args.ordering", "sideways"])


def test_dev_samples_rotate_over_every_family():
    from glm_lightning.modules.pretrain import rotating_sample

    families = ["a"] * 3 + ["b"] * 3 + ["c"] * 3 + ["d"] * 3 + ["e"] * 3
    items = [f"{f}{i % 3}" for i, f in enumerate(families)]
    seen_families, seen_items = set(), set()
    for round_ in range(3):
        picked = rotating_sample(items, families, 2, round_)
        assert len(picked) == 2 and len({p[0] for p in picked}) == 2  # two different families per table
        seen_families |= {p[0] for p in picked}
        seen_items |= set(picked)
    assert seen_families == set("abcde")  # 5 families with 2 rows: all shown within 3 validations
    assert len(seen_items) == 6
    assert {p[0] for p in rotating_sample(items, families, 8, 0)} == set("abcde")
    assert rotating_sample(items[:2], families[:2], 8, 0) == items[:2]


def test_expert_balance_is_logged_at_every_logging_step(tmp_path):
    main(["fit", "--config", CONF, "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.max_steps", "4",
          "--model.init_args.dev_eval", "false", "--trainer.limit_val_batches", "0"])
    scalars, _ = _scalars(tmp_path / "test" / "version_0")
    series = scalars["experts/max_over_mean_layer0"]
    assert len(series) == 4 and len(set(series)) > 1, series  # current each step, not a value from step 0


def test_held_out_families_are_evaluated_and_never_trained(tmp_path, monkeypatch):
    """`heldout_per_family`: the never-trained families' tasks are generated greedily and verified at each validation
    (`val/heldout_pass`, per family); a held-out family the corpus does train on is not asked about."""
    from datamodules import CodeCorpusDataModule

    dm = CodeCorpusDataModule(families=["increment", "double", "decrement"], num_examples=8, heldout_per_family=2)
    dm.setup("fit")
    assert dm.heldout_families == ("triple", "square_plus_one", "max_of_list")
    assert [t.family for t in dm.heldout_tasks] == [f for f in dm.heldout_families for _ in range(2)]
    trained = {ex.group for ex in dm.training_examples()}
    assert not trained & set(dm.heldout_families)
    with pytest.raises(ValueError, match="heldout_per_family needs corpus: functions"):
        CodeCorpusDataModule(corpus="composition", heldout_per_family=1)

    monkeypatch.chdir(tmp_path)
    main(["fit", "--config", CONF, "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"),
          "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
          "--data.init_args.families", "[increment, decrement]", "--data.init_args.heldout_per_family", "1"])
    scalars, _ = _scalars(tmp_path / "logs" / "test" / "version_0")
    per_family = {t: v for t, v in scalars.items() if t.startswith("val/heldout_pass/")}
    assert sorted(per_family) == ["val/heldout_pass/max_of_list", "val/heldout_pass/square_plus_one",
                                  "val/heldout_pass/triple"]
    assert scalars["val/heldout_pass"][0] == pytest.approx(sum(v[0] for v in per_family.values()) / 3)
