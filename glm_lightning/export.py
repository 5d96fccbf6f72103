"""`python -m glm_lightning export --ckpt CKPT --out DIR`: a model to take away, in the formats people's tools read.

DIR gets:
- `model.safetensors`: the shared language model's weights (safetensors: no pickle, memory-mappable, read by
  Hugging Face and most tools); `stage.safetensors` beside it holds a stage's own parts (the vision encoder and
  image-token adapters) when the checkpoint has any;
- `config.json`: the `GLMConfig` fields (the model is rebuilt from them exactly);
- `tokenizer.json`: the byte-level tokenizer (ids 0-255 are UTF-8 bytes, then the specials) and the prompt format;
- `export.json`: where the weights came from (stage, data, steps, final metrics, commit, CPU and threads);
- `README.md`: a model card written from the same record.

`glm_lightning.load(DIR)` reads it back (same logits as the checkpoint; tests/test_export.py). `weights_only_copy`
also writes the slim checkpoints the demo hands from stage to stage: the model and what the next stage reads, no
optimizer state (a full `last.ckpt` stays in each run's folder for resuming).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from glm_lightning.run_record import checkpoint_record, jsonable

RESUME_ONLY_KEYS = ("optimizer_states", "lr_schedulers", "loops", "callbacks", "MixedPrecision",
                    "native_amp_scaling_state")
"""What a Lightning checkpoint keeps only for resuming the same run (for AdamW, twice the model's size)."""

def tokenizer_description() -> dict[str, Any]:
    """The tokenizer as data: nothing to download, the same ids everywhere."""
    from glm_lightning.tasks.task import PROMPT_HEADER
    from glm_lightning.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    return {"type": "byte-level", "vocab_size": tok.vocab_size,
            "bytes": "ids 0-255 are the UTF-8 bytes of the text", "special_ids": tok.special_ids,
            "text_starts_with": "bos", "completion_ends_with": "eos",
            "prompt_format": f"{PROMPT_HEADER}\\n# <description>\\ndef <name>(<args>):"}


def model_card(record: dict[str, Any], config: dict[str, Any], params: dict[str, int], files: list[str]) -> str:
    """README.md of an export: what the model is, how it was made, and how to use it."""
    metrics = record.get("metrics") or {}
    machine = record.get("machine") or {}
    data = record.get("data") or {}
    lines = [f"# glm-lightning model: {config.get('d_model')}-wide, {config.get('n_layers')} layers "
             f"({record.get('stage_name') or 'unknown stage'})", "",
             "A small GLM-5-style byte-level language model trained with glm-lightning on a CPU: manifold-constrained "
             "hyper-connections, Kimi Delta Attention / DeepSeek sparse attention hybrid layers "
             f"(`{config.get('layer_pattern', '')}`), mixture of experts with a shared expert.", "",
             "| | |", "|---|---|",
             f"| parameters | {params['total']:,} ({params['active']:,} active per token) |",
             f"| stage | {record.get('stage_name') or 'unknown'} |",
             f"| optimizer steps | {record.get('global_step')} |"]
    if data:
        shown = {k: data[k] for k in ("corpus", "families", "train_families", "ordering", "num_examples",
                                      "batch_size", "seq_len") if k in data}
        lines.append(f"| data | {json.dumps(shown)} |")
    lines += [f"| code commit | {record.get('commit', 'not recorded')} |",
              f"| machine | {machine.get('cpu', 'not recorded')} [{machine.get('cpu_capability', '?')}], "
              f"{machine.get('threads', '?')} thread(s), torch {machine.get('torch', '?')} |", ""]
    if metrics:
        lines += ["## Metrics at the end of training", "", "| metric | value |", "|---|---|"]
        lines += [f"| `{k}` | {v:.4g} |" for k, v in sorted(metrics.items()) if isinstance(v, (int, float))]
        lines.append("")
    lines += ["## Use", "", "```python", "import glm_lightning", "",
              "model = glm_lightning.load(\"<this folder>\")",
              "print(model.generate(\"def double(x):\"))   # a bare signature gets the training header", "```", "",
              "Or from the shell: `python -m glm_lightning generate --ckpt <this folder> --prompt 'def double(x):'`.",
              "", "The model only knows the prompt format it was trained on (tokenizer.json, `prompt_format`). "
              "A seed fixes its samples on one CPU kind at one thread count.", "",
              "## Files", "", *[f"- `{name}`" for name in files], ""]
    return "\n".join(lines)


def _stage_parts(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Lightning state dict split into the shared model's weights (prefix removed) and the stage's own."""
    model = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    other = {k: v for k, v in state.items() if not k.startswith("model.")}
    return model, other


def export(ckpt_path: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Write the export folder `out` from a checkpoint of any stage (see the module docstring); atomic: the folder
    appears complete or not at all. Refuses a non-empty `out` unless `overwrite`."""
    import torch
    from safetensors.torch import save_file

    from glm_lightning.model import GLMConfig
    from glm_lightning.modules.base import load_checkpoint_file
    from glm_lightning.pretrained import build_model

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ValueError(f"{out} exists and is not empty: choose a new folder, or pass --overwrite")
    ckpt = load_checkpoint_file(ckpt_path)
    cfg = GLMConfig(**ckpt["glm_config"])
    model_state, stage_state = _stage_parts(ckpt.get("state_dict", {}))
    model = build_model(cfg, model_state, ckpt_path)  # the weights fit the config before anything is written
    record = {**checkpoint_record(ckpt), "source_checkpoint": str(Path(ckpt_path).resolve())}
    files = ["model.safetensors", "config.json", "tokenizer.json", "export.json", "README.md"]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tensors = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "library": "glm-lightning"})
        if stage_state:
            save_file({k: v.detach().contiguous().clone() for k, v in stage_state.items()
                       if isinstance(v, torch.Tensor)}, str(tmp / "stage.safetensors"),
                      metadata={"format": "pt", "library": "glm-lightning"})
            files.insert(1, "stage.safetensors")
            for key in ("vision_config", "image_adapters"):
                if key in ckpt:
                    record[key] = jsonable(ckpt[key])
        (tmp / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        (tmp / "tokenizer.json").write_text(json.dumps(tokenizer_description(), indent=2) + "\n")
        (tmp / "export.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        (tmp / "README.md").write_text(model_card(record, cfg.to_dict(), model.num_parameters(), files))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp made it private; an export is for sharing
        for file in tmp.iterdir():
            os.chmod(file, 0o666 & ~umask)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def weights_only_copy(checkpoint: str | Path, dest: str | Path) -> Path:
    """Copy a checkpoint without what only resuming needs (`RESUME_ONLY_KEYS`), atomically; the copy records the
    full checkpoint it came from (`weights_only_of`), which `--ckpt_path` names when asked to resume from it."""
    import torch

    from glm_lightning.modules.base import load_checkpoint_file

    ckpt = load_checkpoint_file(checkpoint)
    slim = {k: v for k, v in ckpt.items() if k not in RESUME_ONLY_KEYS}
    slim["weights_only_of"] = str(Path(checkpoint).resolve())
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    torch.save(slim, tmp)
    os.replace(tmp, dest)
    return dest


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m glm_lightning export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint of any stage (e.g. lightning_logs/demo/rl.ckpt)")
    p.add_argument("--out", required=True, help="the export folder to write (must be new or empty)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing export folder")
    return p


def main(argv: Sequence[str] | None = None) -> Path:
    args = build_parser().parse_args(argv)
    print(f"[export] {args.ckpt} -> {args.out}", flush=True)
    out = export(args.ckpt, args.out, overwrite=args.overwrite)
    size = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    print(f"[export] wrote {', '.join(sorted(f.name for f in out.iterdir()))} ({size:.1f} MB)\n"
          f"[export] use it: python -c \"import glm_lightning; m = glm_lightning.load('{out}'); "
          f"print(m.generate('def double(x):'))\"")
    return out
