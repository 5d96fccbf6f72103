"""StageModule: what every stage (pre-training, vision, RL) shares around the ONE shared `GLMModel`.

- builds the model from a preset name plus field overrides (`--model.init_args.model_overrides '{d_model: 64}'`);
- optionally loads only the model weights (and checks the config) from an earlier stage's checkpoint
  (`init_weights`), since `--ckpt_path` resumes the *same* stage; the checkpoint is read once, and a stage adds its
  own parts through two hooks (`build_stage` before the weights load, `load_stage_weights` with the checkpoint).
  Every stage but pre-training (`starts_from_scratch`) must be told where its weights come from: a run without
  `init_weights` fails before its first step (`check_start_weights`) unless `init_weights: null` says on purpose that
  training starts from random weights;
- AdamW with weight-decay exclusions (norms, biases, embeddings, gates, mHC and KDA gate parameters), linear
  warm-up and cosine decay to `min_lr_ratio * lr`, built from trainable parameters only (so freezing callbacks work);
- the sandboxed verifier of stages that score code (`verifier_settings`), started on first use, closed at teardown;
- at the end of fit, the run's hyperparameters with its final metrics (TensorBoard HPARAMS, `<log dir>/hparams`).

The shared arguments are declared here once; stages take `**kwargs` and forward them, and LightningCLI still lists
them under each stage (`--print_config`, `--help`), because jsonargparse follows the `super().__init__(**kwargs)`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from glm_lightning.evaluation import VerifierSettings
from glm_lightning.model import GLMConfig, GLMModel
from glm_lightning.optim import AdamW
from glm_lightning.run_record import weights_digest
from glm_lightning.rl.config import PolicyLoss, Reward, Sampling

INIT_WEIGHTS_REQUIRED = "required: a checkpoint path, or null for random weights"
"""Default of `init_weights` for stages that continue an earlier stage (vision, RL): not a path, a reminder."""

NO_DECAY_MARKERS = ("bias", "norm", "embed", "A_log", "dt_bias", "alpha", "phi", "router")


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Vectors (norm scales, biases, gate offsets) and embeddings/routers/mHC maps are not decayed."""
    return param.dim() < 2 or any(marker in name for marker in NO_DECAY_MARKERS)


CHECKPOINT_GLOBALS: tuple[type, ...] = (VerifierSettings, Sampling, Reward, PolicyLoss)
"""Every non-builtin type a glm-lightning checkpoint may hold: the settings dataclasses a stage module built in Python
(not from YAML) keeps in its hyperparameters. Checkpoints load with `weights_only=True` and this allow-list, never
with `weights_only=False`."""


def allow_checkpoint_globals() -> None:
    """Let every `torch.load(..., weights_only=True)` of this process (Lightning's resume included) read the types
    of `CHECKPOINT_GLOBALS`."""
    torch.serialization.add_safe_globals(list(CHECKPOINT_GLOBALS))


def load_checkpoint_file(path: str | Path) -> dict[str, Any]:
    """The dict of a checkpoint file, read with `weights_only=True` (tensors, builtins and `CHECKPOINT_GLOBALS`);
    a missing file, a folder or a file that is no checkpoint is a ValueError / FileNotFoundError naming it."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder, not a checkpoint file (e.g. {path / 'checkpoints' / 'last.ckpt'})")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        with torch.serialization.safe_globals(list(CHECKPOINT_GLOBALS)):
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - pickle/zip errors of a file that is no checkpoint at all
        raise ValueError(f"{path} is not a checkpoint (torch.load failed: {type(err).__name__})") from None
    if not isinstance(ckpt, dict) or "glm_config" not in ckpt:
        raise ValueError(f"{path} is not a glm-lightning checkpoint (no 'glm_config' entry)")
    return ckpt


def read_checkpoint(path: str | Path) -> tuple[GLMConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """Model config, model weights and the whole checkpoint dict of any glm-lightning stage (or a raw export)."""
    ckpt = load_checkpoint_file(path)
    state = ckpt.get("state_dict", ckpt.get("model_state_dict", {}))
    model_state = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    return GLMConfig(**ckpt["glm_config"]), model_state or state, ckpt


STAGE_OF_MODULE = {"PretrainModule": "pretrain", "VisionModule": "vision", "RLModule": "rl"}
"""Each stage module's config name (configs/<name>.yaml, configs/demo/<name>.yaml)."""


def preset_of(cfg: GLMConfig) -> str | None:
    """The preset `cfg` is, field for field (the vocabulary aside), else None."""
    from glm_lightning.model.config import PRESETS

    mine = {k: v for k, v in cfg.to_dict().items() if k != "vocab_size"}
    for name, preset in PRESETS.items():
        if {k: v for k, v in preset.to_dict().items() if k != "vocab_size"} == mine:
            return name
    return None


def check_same_model(path: str | Path, theirs: GLMConfig, mine: GLMConfig, stage: str | None = None) -> None:
    """Refuse a checkpoint trained with another model config than this run's (`init_weights` and `--ckpt_path`
    alike; the vocabulary may differ, the model grows it), in one line: which preset each is, the first differing
    fields, and the overlay that fits (`stage`: the stage config's name, e.g. "rl" -> configs/demo/rl.yaml)."""
    a, b = theirs.to_dict(), mine.to_dict()
    diff = {k: (a[k], b[k]) for k in b if k in a and b[k] != a[k] and k != "vocab_size"}
    if not diff:
        return
    shown = ", ".join(f"{k} {x!r} vs {y!r}" for k, (x, y) in list(diff.items())[:3])
    more = f" and {len(diff) - 3} more" if len(diff) > 3 else ""
    theirs_preset, mine_preset = preset_of(theirs), preset_of(mine)
    fix = "use the config and overrides of the run that wrote it"
    if theirs_preset is not None and mine_preset is not None and theirs_preset != mine_preset:
        overlay = Path("configs") / theirs_preset / f"{stage}.yaml" if stage else None
        if overlay is not None and (Path(__file__).resolve().parents[2] / overlay).is_file():
            fix = f"add its overlay (--config {overlay}) or --model.init_args.preset {theirs_preset}"
        else:
            fix = f"use --model.init_args.preset {theirs_preset}"
    kinds = (f"a {theirs_preset!r} model, this run builds {mine_preset!r}; " if theirs_preset and mine_preset
             else "")
    raise ValueError(f"checkpoint {path} was trained with a different model config ({kinds}{shown}{more}: "
                     f"checkpoint vs this run): {fix}")


SHIPPED_START_CHECKPOINTS = {
    "flash-25m": "lightning_logs/pretrain/version_0/checkpoints/last.ckpt, which "
                 "`python -m glm_lightning fit --config configs/pretrain.yaml` writes",
    "demo": "lightning_logs/demo/pretrain.ckpt, which `python -m glm_lightning demo --stages pretrain` writes",
}
"""Where the documented pre-training commands leave a checkpoint of each preset (as shipped, no overrides)."""


def start_checkpoint_hint(preset: str, overrides: dict[str, Any] | None) -> str:
    """A checkpoint of the same model config to start from: the documented one, else how to make one."""
    if not overrides and preset in SHIPPED_START_CHECKPOINTS:
        return f"e.g. {SHIPPED_START_CHECKPOINTS[preset]}"
    made = f"preset {preset!r}" + (f" with model_overrides {dict(overrides)}" if overrides else "")
    return f"a checkpoint of a run with the same model ({made})"


class StageModule(pl.LightningModule):
    """Base class of the stage modules; owns the shared model, optimizer and schedule."""

    verifier_settings: VerifierSettings | None = None
    """Set by stages that score code (pre-training's dev pass, RL); evaluation callbacks then share their verifier."""

    starts_from_scratch: bool = False
    """True for stages meant to start from random weights (pre-training); others need `init_weights`."""

    def __init__(
        self,
        preset: str = "flash-25m",
        model_overrides: dict[str, Any] | None = None,
        init_weights: str | None = INIT_WEIGHTS_REQUIRED,
        lr: float = 3e-3,
        min_lr_ratio: float = 0.1,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 50,
    ) -> None:
        """
        Args:
            preset: model preset (`tiny`, `demo`, `flash-25m`; see `GLMConfig.preset`).
            model_overrides: GLMConfig fields that differ from the preset, e.g. `{d_model: 64, n_layers: 2}`. Fields:
                MODEL_FIELDS
            init_weights: checkpoint of any stage with the same model config: its model weights are loaded. A stage
                that continues an earlier one (vision, RL) refuses to train without it; `null` starts from random
                weights on purpose.
            lr: peak learning rate (AdamW).
            min_lr_ratio: cosine decay ends at min_lr_ratio * lr (1 = constant).
            weight_decay: AdamW weight decay (not applied to norms, biases, embeddings, gates, routers).
            betas: AdamW betas.
            warmup_steps: linear warm-up steps.
        """
        if lr <= 0 or not 0 <= min_lr_ratio <= 1 or weight_decay < 0 or warmup_steps < 0:
            raise ValueError("need lr > 0, 0 <= min_lr_ratio <= 1, weight_decay >= 0, warmup_steps >= 0")
        super().__init__()
        self._verifier: Any = None
        self.save_hyperparameters()  # collects the calling stage's own arguments too
        self.glm_config = GLMConfig.preset(preset, **(model_overrides or {}))
        self.model = GLMModel(self.glm_config)
        self.build_stage()
        if init_weights and init_weights != INIT_WEIGHTS_REQUIRED:
            self.load_model_weights(init_weights)

    def check_start_weights(self) -> None:
        """Refuse to train or evaluate a continuing stage that was not told where its weights come from."""
        if self.hparams.get("init_weights") == INIT_WEIGHTS_REQUIRED and not self.starts_from_scratch:
            hint = start_checkpoint_hint(self.hparams.get("preset", "flash-25m"), self.hparams.get("model_overrides"))
            raise ValueError(
                f"{type(self).__name__} continues an earlier stage but model.init_args.init_weights is not set: set it "
                f"to that stage's checkpoint ({hint}), or to null to start from random weights on purpose")

    def promised_metrics(self, datamodule: Any) -> list[str] | None:
        """Glob patterns of every metric key this stage logs with `datamodule` (None: not declared). The preflight
        check refuses a checkpoint/early-stopping monitor outside them before training starts."""
        return None

    # --- hooks for a stage's own parts ---------------------------------------------------------------------------
    def build_stage(self) -> None:
        """Build stage-specific submodules (from `self.hparams`) that checkpoints may carry weights for."""

    def load_stage_weights(self, checkpoint: dict[str, Any], path: str | Path, strict: bool) -> None:
        """Load stage-specific weights from an already-read checkpoint (called after the model's)."""

    # --- the sandbox -------------------------------------------------------------------------------------------------
    @property
    def verifier(self) -> Any:
        """The stage's sandboxed verifier, started on first use; None for a stage without `verifier_settings`."""
        if self._verifier is not None and getattr(self._verifier, "owner_pid", os.getpid()) != os.getpid():
            self._verifier = None  # a fork (DDP, dataloader workers) inherited the parent's, which refuses it: own one
        if self._verifier is None and self.verifier_settings is not None:
            self._verifier = self.verifier_settings.build()
        return self._verifier

    def close_verifier(self) -> None:
        """Stop the verifier's processes (a later use starts a fresh one)."""
        if self._verifier is not None:
            try:
                self._verifier.close()
            finally:
                self._verifier = None

    def teardown(self, stage: str) -> None:
        self.close_verifier()

    # --- weights from earlier stages -----------------------------------------------------------------------------
    def load_model_weights(self, path: str | Path, strict: bool = True) -> None:
        """Load the shared model's weights (the checkpoint's model config must match this module's), then the
        stage's own through `load_stage_weights`; the file is read once."""
        cfg, state, ckpt = read_checkpoint(path)
        check_same_model(path, cfg, self.glm_config, STAGE_OF_MODULE.get(type(self).__name__))
        loaded = dict(self.hparams.get("loaded_weights") or {})
        loaded[str(path)] = weights_digest(path)
        self.hparams["loaded_weights"] = loaded  # in hparams.yaml: a sweep checks it when it reuses the run
        if "lm_head.weight" in state:  # the checkpoint's stage (e.g. RL) trained an untied output head
            self.model.untie_head()
        self.model.load_state_dict(state, strict=strict)
        self.load_stage_weights(ckpt, path, strict)

    machine: dict[str, Any] | None = None
    """The run's machine (CPU kind, torch's CPU capability, threads, versions: `glm_lightning.machine`), set by the
    stage CLI; every checkpoint and the final HPARAMS entry carry it (a seed fixes a run only on one of these)."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["glm_config"] = self.glm_config.to_dict()
        checkpoint["stage"] = type(self).__name__
        if self.machine is not None:
            checkpoint["machine"] = dict(self.machine)
        if self._trainer is not None:  # what an export's model card reports (glm_lightning.export)
            checkpoint["metrics"] = final_metrics(self.trainer)
            checkpoint["commit"] = code_commit()

    # --- dashboards ---------------------------------------------------------------------------------------------
    def on_fit_end(self) -> None:
        log_final_hparams(self.trainer, {**dict(self.hparams), **({"machine": self.machine} if self.machine else {})})

    # --- optimisation -------------------------------------------------------------------------------------------
    def param_groups(self) -> list[dict[str, Any]]:
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if p.requires_grad:
                (no_decay if no_weight_decay(name, p) else decay).append(p)
        if not decay and not no_decay:
            raise ValueError("no trainable parameters (everything is frozen)")
        return [{"params": decay, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]

    def lr_lambda(self, step: int) -> float:
        """Linear warm-up then cosine decay to min_lr_ratio, over the trainer's planned optimizer steps."""
        hp = self.hparams
        total = max(1, int(self.trainer.estimated_stepping_batches)) if self._trainer else 1
        if step < hp.warmup_steps:
            return (step + 1) / (hp.warmup_steps + 1)
        progress = min(1.0, (step - hp.warmup_steps) / max(1, total - hp.warmup_steps))
        return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def configure_optimizers(self) -> dict[str, Any]:
        # torch's fused kernel with one step counter shared by all parameters (glm_lightning/optim.py)
        opt = AdamW(self.param_groups(), lr=self.hparams.lr, betas=tuple(self.hparams.betas))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, self.lr_lambda)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def clip_gradients(self, optimizer: Any, gradient_clip_val: float | None = None,
                       gradient_clip_algorithm: str | None = None) -> None:
        """Lightning's clipping, except under bf16-mixed: there Lightning's mixed-precision plugin refuses to clip for
        a fused optimizer ("it unscales gradients internally"), a check for fp16's loss scaler; bf16-mixed has no
        scaler (the grads reach the fp32 master weights unscaled), so the fused AdamW's grads are clipped as in fp32."""
        from lightning.pytorch.plugins.precision import MixedPrecision, Precision
        from lightning.pytorch.utilities import GradClipAlgorithmType

        plugin = self.trainer.precision_plugin
        if not (isinstance(plugin, MixedPrecision) and plugin.scaler is None):
            return super().clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        clip_val = gradient_clip_val if gradient_clip_val is not None else self.trainer.gradient_clip_val or 0.0
        algorithm = GradClipAlgorithmType((gradient_clip_algorithm or self.trainer.gradient_clip_algorithm
                                           or "norm").lower())
        Precision.clip_gradients(plugin, optimizer, clip_val, algorithm)
        return None


def model_field_docs() -> str:
    """`field (its docstring); ...` for every GLMConfig field, read from the attribute docstrings in config.py, so
    `fit --help` describes every model knob under `model_overrides`."""
    import ast
    import inspect

    from glm_lightning.model import config as config_module

    body = ast.parse(inspect.getsource(config_module.GLMConfig)).body[0].body
    parts = []
    for node, doc in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(doc, ast.Expr) \
                and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
            parts.append(f"{node.target.id} ({' '.join(doc.value.value.split()).rstrip('.')})")
    return "; ".join(parts) + "."


if StageModule.__init__.__doc__:
    StageModule.__init__.__doc__ = StageModule.__init__.__doc__.replace("MODEL_FIELDS", model_field_docs())


def code_commit() -> str:
    """The code's commit (short hash, marked when tracked files have uncommitted changes), read once per process."""
    global _COMMIT
    if _COMMIT is None:
        from glm_lightning.sweep.fingerprint import git_revision

        _COMMIT = git_revision()
    return _COMMIT


_COMMIT: str | None = None


def final_metrics(trainer: pl.Trainer) -> dict[str, float]:
    """The run's last value of every scalar metric (what `trainer.callback_metrics` holds at the end)."""
    out = {}
    for key, value in trainer.callback_metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1 and torch.isfinite(value):
            out[key] = float(value)
    return out


def log_final_hparams(trainer: pl.Trainer, hparams: dict[str, Any]) -> Path | None:
    """TensorBoard HPARAMS entry of a single run: its hyperparameters with its final metrics (as `hparams/<key>`
    scalars in `<log dir>/hparams`, so the run's own curves get no extra points)."""
    from lightning.fabric.utilities.logger import _convert_params, _flatten_dict, _sanitize_params
    from lightning.pytorch.loggers import TensorBoardLogger
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams as hparams_summaries

    logger = trainer.logger
    metrics = final_metrics(trainer)
    if trainer.global_rank != 0 or not isinstance(logger, TensorBoardLogger) or not metrics or trainer.fast_dev_run:
        return None
    params = _sanitize_params(_flatten_dict(_convert_params({k: v for k, v in hparams.items()
                                                              if not k.startswith("_")})))
    params = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in params.items()}
    out = Path(logger.log_dir) / "hparams"
    tagged = {f"hparams/{k}": v for k, v in metrics.items()}
    with SummaryWriter(str(out)) as writer:
        for summary in hparams_summaries(params, tagged):
            writer._get_file_writer().add_summary(summary)
        for tag, value in tagged.items():
            writer.add_scalar(tag, value, trainer.global_step)
    return out
