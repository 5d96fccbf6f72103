"""`glm_lightning.load(path)`: a trained model to use from Python, from an export folder (`python -m glm_lightning
export`) or any stage's checkpoint.

    import glm_lightning
    model = glm_lightning.load("exports/demo-rl")            # or lightning_logs/demo/rl.ckpt
    print(model.generate("def double(x):"))                   # a bare signature gets the training header
    sample = model.sample("...", temperature=0.7, seed=1)     # text + why it stopped
    logits = model.logits("def f(x):")                        # [T, vocab] for the prompt's tokens

The model knows one prompt format, the one it was trained on (`glm_lightning.tasks.task.PROMPT_HEADER`, a comment
line, then `def name(args):`); a prompt that is only a signature (optionally after comment lines) is wrapped in that
header unless `wrap=False`, and `sample` says whether it was.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from glm_lightning.model import GLMConfig, GLMModel
from glm_lightning.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
BANNED = (TOK.pad_id, TOK.bos_id, TOK.image_start_id, TOK.image_id, TOK.image_end_id)
"""Ids a text completion never samples (the specials other than eos)."""

EXPORT_FILES = ("config.json", "model.safetensors")
"""What makes a folder an export (`glm_lightning.export`): the model config and the LM's weights."""

SIGNATURE = re.compile(r"^(?:#[^\n]*\n)*def \w+\([^)]*\):\s*$")
"""A prompt the user wrote as a bare signature, maybe after comment lines: `def double(x):`."""

STOP_END_TOKEN = "end token"
STOP_TOKEN_LIMIT = "token limit"
STOP_RULE = "stop rule (a full `return` line)"
STOP_CONTEXT = "context full"


def as_training_prompt(prompt: str) -> tuple[str, bool]:
    """The prompt in the format the model was trained on, and whether it had to be wrapped: a bare signature
    (`def double(x):`, optionally after `# ...` lines) gets `PROMPT_HEADER` on top (and its name as the description
    when it has none); anything else is left as written."""
    from glm_lightning.tasks.task import PROMPT_HEADER

    text = prompt.strip("\n")
    if text.startswith(PROMPT_HEADER) or not SIGNATURE.match(text + "\n"):
        return prompt, False
    lines = text.split("\n")
    comments = [ln for ln in lines[:-1] if ln.strip()]
    if not comments:
        name = re.match(r"def (\w+)", lines[-1]).group(1)  # type: ignore[union-attr]
        comments = [f"# {name.replace('_', ' ').capitalize()}."]
    return "\n".join([PROMPT_HEADER, *comments, lines[-1].rstrip()]), True


@dataclass
class Sample:
    """One completion and why it ended (`STOP_*`), with the prompt the model actually saw."""

    text: str
    stop: str
    prompt: str
    wrapped: bool = False
    tokens: list[int] = field(default_factory=list)


@torch.inference_mode()
def stream_sample(model: GLMModel, prompt: str, max_new_tokens: int, temperature: float,
                  generator: torch.Generator, on_text: Callable[[str], None] | None = None,
                  stop: Callable[[list[int]], bool] | None = None) -> Sample:
    """One completion decoded token by token with the model's caches; `on_text` gets each new piece of text."""
    from glm_lightning.generation import sample_next

    if not prompt:
        raise ValueError("the prompt is empty: give some text to continue (--prompt) or a task (--task FAMILY)")
    emit = on_text or (lambda _text: None)
    ids = torch.tensor([TOK.encode(prompt, bos=True)])
    model.check_ids(ids)
    room = model.cfg.max_seq_len - ids.shape[1]
    budget = min(max_new_tokens, room)
    if budget < 1:
        raise ValueError(f"the prompt has {ids.shape[1]} tokens; the model's context is {model.cfg.max_seq_len}")
    cache = model.new_cache(1)
    logits = model(ids, valid=torch.ones_like(ids, dtype=torch.bool), cache=cache).logits[:, -1]
    tokens: list[int] = []
    shown = ""
    reason = STOP_TOKEN_LIMIT if budget == max_new_tokens else STOP_CONTEXT
    for step in range(budget):
        logits[:, list(BANNED)] = float("-inf")
        tok, _ = sample_next(logits, temperature, None, None, generator)
        if int(tok) == TOK.eos_id:
            reason = STOP_END_TOKEN
            break
        tokens.append(int(tok))
        text = TOK.decode(tokens)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            emit(text[len(shown):])
            shown = text
        if stop is not None and text.endswith("\n") and stop(tokens):
            reason = STOP_RULE
            break
        if step + 1 < budget:
            logits = model(tok[:, None], valid=torch.ones(1, 1, dtype=torch.bool), cache=cache).logits[:, -1]
    text = TOK.decode(tokens)
    emit(text[len(shown):])
    return Sample(text=text, stop=reason, prompt=prompt, tokens=tokens)


def read_export(folder: str | Path) -> tuple[GLMConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """Model config, LM weights and the export's metadata (`export.json`) of an export folder; a missing, truncated
    or foreign file is a one-line ValueError naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    missing = [name for name in EXPORT_FILES if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"{folder} is a folder but not a glm-lightning export (missing {', '.join(missing)}): give a "
                         "checkpoint file, or an export folder (`python -m glm_lightning export --ckpt CKPT --out DIR`)")
    try:
        config = json.loads((folder / "config.json").read_text())
        cfg = GLMConfig(**{k: v for k, v in config.items() if not k.startswith("_")})
    except (json.JSONDecodeError, TypeError) as err:
        raise ValueError(f"{folder / 'config.json'} is not a glm-lightning model config ({err})") from None
    weights = folder / "model.safetensors"
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"{weights} is not a readable safetensors file (truncated or foreign? {first})") from None
    meta_file = folder / "export.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    return cfg, state, meta


def build_model(cfg: GLMConfig, state: dict[str, torch.Tensor], source: str | Path) -> GLMModel:
    """A GLMModel with `state` loaded, in eval mode; weights that do not fit the config are one line naming
    `source` and the first mismatched keys."""
    model = GLMModel(cfg)
    if "lm_head.weight" in state:
        model.untie_head()
    mine = model.state_dict()
    missing = sorted(set(mine) - set(state))
    unexpected = sorted(set(state) - set(mine))
    wrong = sorted(k for k in set(mine) & set(state) if tuple(mine[k].shape) != tuple(state[k].shape))
    if missing or unexpected or wrong:
        parts = [f"{label} {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}" for label, keys in
                 (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if keys]
        raise ValueError(f"{source}: the weights do not fit the glm-lightning model of its config ({'; '.join(parts)})")
    model.load_state_dict(state)
    return model.eval()


def read_weights(path: str | Path) -> tuple[GLMConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """Model config, LM weights and the run's record of an export folder (`export.json`) or any stage's checkpoint
    (`run_record.checkpoint_record`), each file read once; a folder that is no export is a one-line error."""
    if Path(path).is_dir():
        return read_export(path)
    from glm_lightning.modules.base import read_checkpoint
    from glm_lightning.run_record import checkpoint_record

    cfg, state, ckpt = read_checkpoint(path)
    return cfg, state, checkpoint_record(ckpt)


def load_model(path: str | Path) -> GLMModel:
    """The shared model of an export folder or any stage's checkpoint, in eval mode."""
    cfg, state, _ = read_weights(path)
    return build_model(cfg, state, path)


class Pretrained:
    """A trained model with its generation defaults: `generate` for text, `sample` for text + stop reason,
    `logits` for the next-token scores, `.model` for the `GLMModel` itself."""

    def __init__(self, model: GLMModel, source: str | Path, info: dict[str, Any] | None = None) -> None:
        self.model = model
        self.source = str(source)
        self.info = dict(info or {})

    @property
    def config(self) -> GLMConfig:
        return self.model.cfg

    def __repr__(self) -> str:
        n = self.model.num_parameters()
        return f"Pretrained({self.source!r}, {n['total'] / 1e6:.2f}M parameters, {self.info.get('stage') or 'stage ?'})"

    def sample(self, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0,
               wrap: bool = True, stop_at_return: bool = True,
               on_text: Callable[[str], None] | None = None) -> Sample:
        """One completion of `prompt` (wrapped in the training header when it is a bare signature and `wrap`);
        greedy at temperature 0; stops at the end token, `max_new_tokens`, or a full `return` line."""
        from glm_lightning.evaluation import completion_finished

        seen, wrapped = as_training_prompt(prompt) if wrap else (prompt, False)
        generator = torch.Generator().manual_seed(seed)
        out = stream_sample(self.model, seen, max_new_tokens, temperature, generator, on_text,
                            stop=completion_finished if stop_at_return else None)
        out.wrapped = wrapped
        return out

    def generate(self, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0,
                 wrap: bool = True) -> str:
        """The completion's text (see `sample`)."""
        return self.sample(prompt, max_new_tokens, temperature, seed, wrap).text

    @torch.inference_mode()
    def logits(self, text: str) -> torch.Tensor:
        """Next-token logits [T, vocab] after each token of `text` (bos first)."""
        ids = torch.tensor([TOK.encode(text, bos=True)])
        self.model.check_ids(ids)
        return self.model(ids).logits[0]


def load(path: str | Path) -> Pretrained:
    """A trained model from an export folder or any stage's checkpoint (see the module docstring)."""
    cfg, state, info = read_weights(path)
    return Pretrained(build_model(cfg, state, path), path, info)
