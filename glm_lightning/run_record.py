"""What a checkpoint says about the run that wrote it (stage, steps, final metrics, data, commit, machine), as
plain JSON-ready data: read by `export` (export.json, the model card), `glm_lightning.load` (`.info`), `generate`
(which families to sample) and the stage CLI (which stage a `--ckpt_path` belongs to)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

STAGE_NAMES = {"PretrainModule": "pre-training", "VisionModule": "vision fine-tuning", "RLModule": "RL"}


def checkpoint_record(ckpt: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint says about its run: stage, steps, final metrics, data, commit and machine (the fields a
    checkpoint written before they were recorded lacks are left out)."""
    hp = dict(ckpt.get("hyper_parameters") or {})
    stage = ckpt.get("stage") or str(hp.get("_class_path", "")).rpartition(".")[2] or None
    if stage is None:
        stage = "VisionModule" if "vision_config" in ckpt else None
    record: dict[str, Any] = {"stage": stage, "stage_name": STAGE_NAMES.get(stage or "", stage),
                              "global_step": ckpt.get("global_step"), "epoch": ckpt.get("epoch")}
    for key in ("metrics", "commit", "machine", "weights_only_of"):
        if ckpt.get(key) is not None:
            record[key] = ckpt[key]
    data = ckpt.get("datamodule_hyper_parameters")
    if data:
        record["data"] = {k: v for k, v in dict(data).items() if not str(k).startswith("_")}
    record["hyper_parameters"] = {k: v for k, v in hp.items() if not str(k).startswith("_")}
    return jsonable(record)


def jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:
        return value.item()
    if hasattr(value, "__dataclass_fields__"):
        import dataclasses

        return jsonable(dataclasses.asdict(value))
    return str(value)


def weights_digest(path: str | Path) -> str:
    """The first 16 hex digits of a weights file's sha256: what a run records of every checkpoint it loads, so a
    sweep can tell a run made from other weights even when no argument or config file named them (issue 47)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:16]
