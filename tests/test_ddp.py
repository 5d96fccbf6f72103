"""Scale-out: pre-training and RL run under Lightning's DDP strategy on CPU (gloo), 2 processes, a few steps.

Run through the real command line (`python -m glm_lightning fit ... --trainer.strategy ddp`), so Lightning's
subprocess launcher starts rank 1 exactly as it would for a user. Each rank records a fingerprint of its weights
after training; DDP keeps replicas identical, so the two fingerprints must agree (and differ from the start).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "tests" / "conf"


def fit_ddp(tmp_path: Path, config: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "GLM_FINGERPRINT_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "glm_lightning", "fit", "--config", str(CONF / config),
           "--trainer.devices", "2", "--trainer.strategy", "ddp",
           "--trainer.callbacks+=tests.ddp_fingerprint.WeightFingerprint", *extra]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def fingerprints(tmp_path: Path) -> dict[int, dict]:
    out = {}
    for path in tmp_path.glob("fingerprint-rank*.json"):
        rec = json.loads(path.read_text())
        out[rec["rank"]] = rec
    return out


def test_pretrain_ddp_two_processes(tmp_path):
    fit_ddp(tmp_path, "pretrain_tiny.yaml", "--trainer.max_steps", "3", "--trainer.limit_val_batches", "1",
            "--trainer.val_check_interval", "3")
    fp = fingerprints(tmp_path)
    assert sorted(fp) == [0, 1], "both ranks must run"
    assert fp[0]["world_size"] == fp[1]["world_size"] == 2
    assert fp[0]["global_step"] == fp[1]["global_step"] == 3
    assert fp[0]["weights"] == pytest.approx(fp[1]["weights"], rel=1e-6), "DDP replicas diverged"
    assert fp[0]["weights"] != pytest.approx(fp[0]["start"], rel=1e-6), "no update happened"
    assert fp[0]["expert_bias"] == pytest.approx(fp[1]["expert_bias"]), "MoE balance bias diverged across ranks"
    ckpts = list((tmp_path / "lightning_logs").rglob("*.ckpt"))
    assert ckpts and torch.load(ckpts[0], map_location="cpu", weights_only=False)["global_step"] == 3


def test_rl_ddp_two_processes(tmp_path):
    fit_ddp(tmp_path, "rl_tiny.yaml", "--trainer.max_steps", "2",
            "--model.class_path", "tests.ddp_fingerprint.LengthRewardRL")
    fp = fingerprints(tmp_path)
    assert sorted(fp) == [0, 1]
    assert fp[0]["global_step"] == fp[1]["global_step"] >= 1  # 4 prompts / (2 per batch x 2 ranks) per epoch
    assert fp[0]["weights"] == pytest.approx(fp[1]["weights"], rel=1e-6), "DDP replicas diverged"
    assert fp[0]["weights"] != pytest.approx(fp[0]["start"], rel=1e-6), "no update happened"
    rollouts = {p.name: [json.loads(line) for line in p.read_text().splitlines()]
                for p in (tmp_path / "lightning_logs").rglob("rollouts*.jsonl")}
    assert sorted(rollouts) == ["rollouts.jsonl", "rollouts_rank1.jsonl"], "each rank generates its own groups"
    ids = [{r["task_id"] for r in rows} for rows in rollouts.values()]
    assert not ids[0] & ids[1], "a prompt's group must stay on one rank"
