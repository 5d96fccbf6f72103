"""What fixes a run besides its seed (CPU kind + threads) is set by `--threads` and recorded with every run: the same
seed at the same thread count gives the same weights twice; the count is in hparams.yaml, the checkpoint and the
final HPARAMS entry."""

from pathlib import Path

import pytest
import torch
import yaml

from glm_lightning.cli import main
from glm_lightning.machine import cpu_capability, cpu_model

CONF = str(Path(__file__).parent / "conf" / "pretrain_tiny.yaml")


def _fit(tmp_path: Path, name: str, threads: int) -> tuple[dict[str, torch.Tensor], dict, dict]:
    save_dir = tmp_path / name
    main(["fit", "--config", CONF, "--threads", str(threads), "--trainer.logger.init_args.save_dir", str(save_dir),
          "--trainer.limit_val_batches", "0", "--trainer.max_steps", "3",
          "--trainer.default_root_dir", str(save_dir)])
    run_dir = save_dir / "test" / "version_0"
    ckpt = torch.load(next(run_dir.glob("checkpoints/last.ckpt")), map_location="cpu", weights_only=False)
    hparams = yaml.safe_load((run_dir / "hparams.yaml").read_text())
    return ckpt["state_dict"], ckpt["machine"], hparams


@pytest.mark.parametrize("threads", [1, 2])
def test_same_seed_same_threads_same_weights_and_the_count_is_recorded(tmp_path, threads):
    first, machine, hparams = _fit(tmp_path, "a", threads)
    second, machine2, _ = _fit(tmp_path, "b", threads)
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), f"{key} differs between two runs at {threads} thread(s)"
    assert machine == machine2
    assert machine["threads"] == threads and hparams["machine"]["threads"] == threads
    assert machine["cpu"] == cpu_model() and machine["cpu_capability"] == cpu_capability()
    assert machine["torch"] == torch.__version__
