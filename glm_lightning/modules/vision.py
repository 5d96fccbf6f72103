"""VisionModule: digit images as tokens for the shared language model (vision fine-tuning stage).

Every example is the byte sequence ::

    <bos> <image_start> <image> x N <image_end> "Digit: "  ->  answer byte ("7")  ->  <eos>

where the N `<image>` placeholders (16 by default) are replaced by the vision encoder's tokens
(:mod:`glm_lightning.model.vision`) before the shared :class:`GLMModel` runs on ``input_embeds``. The loss is the
cross-entropy of the answer byte at the last prompt position (optionally also of `<eos>` after it) plus the model's
aux loss; the predicted class is the argmax over the ten digit bytes '0'..'9' at that position.

Validation/test log `val/acc`, `test/acc` (torchmetrics multiclass accuracy) and the loss; with a TensorBoard logger
they also add a confusion-matrix figure and a grid of images titled with predicted/true labels (never during the
sanity check). `init_weights` loads the language-model weights of any stage's checkpoint (pre-training, vision, RL);
from a vision checkpoint with the same vision config the encoder weights are loaded too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix

from glm_lightning.image_adapters import ImageTokenAdapters
from glm_lightning.lora import apply_lora, is_lora_parametrized, lora_checkpoint_state, merge_lora, restore_lora_state
from glm_lightning.modules.lr_groups import build_param_groups, parse_lr_groups
from glm_lightning.model.vision import VisionConfig, VisionEncoder, splice_image_features
from glm_lightning.modules.base import StageModule
from glm_lightning.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
DIGIT_IDS = tuple(TOK.encode("0123456789"))
NUM_CLASSES = 10
IGNORE = -100
LORA_KEYS = {"targets", "rank", "alpha", "merge_at_end"}
IMAGE_ADAPTER_KEYS = {"targets", "rank", "alpha"}


def image_prompt_ids(num_image_tokens: int, prompt: str = "Digit: ") -> list[int]:
    """``<bos><image_start><image>*N<image_end>`` followed by the bytes of `prompt`."""
    return ([TOK.bos_id, TOK.image_start_id] + [TOK.image_id] * num_image_tokens + [TOK.image_end_id]
            + TOK.encode(prompt))


class VisionModule(StageModule):
    """Vision fine-tuning stage. Batches: ``image`` float [B, C, S, S] (normalised), ``label`` long [B] in 0..9."""

    prompt_ids: torch.Tensor
    digit_ids: torch.Tensor

    def __init__(
        self,
        vision: dict[str, Any] | None = None,
        prompt: str = "Digit: ",
        eos_loss: bool = False,
        aux_loss_weight: float = 1.0,
        log_images: int = 16,
        lr_groups: list[dict[str, Any]] | None = None,
        lora: dict[str, Any] | None = None,
        text_loss_weight: float = 1.0,
        image_adapters: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """
        Args:
            vision: :class:`VisionConfig` fields (e.g. ``{encoder: direct, patch_size: 8}``); defaults otherwise.
            prompt: text between `<image_end>` and the answer byte.
            eos_loss: also train `<eos>` after the answer byte.
            aux_loss_weight: multiplier on the model's aux loss (MoE balance + DSA indexer).
            log_images: images in the TensorBoard prediction grid (0 = no grid).
            lr_groups: per-group learning rates by parameter-name pattern, first match wins, `lr: 0` freezes
                (:mod:`glm_lightning.modules.lr_groups`), e.g. ``[{name: encoder, params: ["vision.*"], lr: 3e-3}]``.
            lora: low-rank adapters on the matched weights, added after `init_weights` loads (their base weights
                are frozen): ``{targets: ["model.blocks.*.mixer.*_proj.weight"], rank: 8, alpha: 16,
                merge_at_end: true}``. Checkpoints always hold the merged weights (plus the adapters, for resuming).
            text_loss_weight: weight of the next-token loss on replayed text batches (``batch["text"]``, served
                by DigitsDataModule's `text_replay`).
            image_adapters: low-rank adapters that act only at image-token positions
                (:mod:`glm_lightning.image_adapters`), in parallel to the matched sublayers:
                ``{targets: ["model.blocks.*.mixer", "model.blocks.*.moe"], rank: 16, alpha: 16}``. Text-only inputs
                then run exactly the loaded language model. Their parameters are named ``image_adapters.*`` (give
                them an `lr_groups` entry); they stay separate in the checkpoint (they cannot be merged).
            **kwargs: the shared stage arguments (`StageModule`: preset, model_overrides, init_weights, lr, ...).
        """
        if aux_loss_weight < 0 or log_images < 0 or text_loss_weight < 0:
            raise ValueError("aux_loss_weight, log_images and text_loss_weight must be >= 0")
        self._lr_groups = parse_lr_groups(lr_groups)
        lora = check_lora(lora)
        self._image_adapter_spec = check_image_adapters(image_adapters)
        super().__init__(**kwargs)
        self.lora_targets: list[str] = []
        if lora is not None:  # after init_weights: the checkpoint's plain weights are the adapters' base
            self.lora_targets = apply_lora(self, lora["targets"], rank=lora["rank"], alpha=lora["alpha"])
            for name, p in self.named_parameters():
                if name.endswith(".original"):
                    p.requires_grad_(False)
        self.train_acc = MulticlassAccuracy(NUM_CLASSES, average="micro")
        self.val_acc = MulticlassAccuracy(NUM_CLASSES, average="micro")
        self.test_acc = MulticlassAccuracy(NUM_CLASSES, average="micro")
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()
        self.val_confmat = MulticlassConfusionMatrix(NUM_CLASSES)
        self.test_confmat = MulticlassConfusionMatrix(NUM_CLASSES)
        self._shown: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    # --- the stage's own parts (built before, loaded after the shared model's weights) ----------------------------
    def build_stage(self) -> None:
        self.vision_config = VisionConfig.from_dict(self.hparams.vision)
        self.vision = VisionEncoder(self.vision_config, self.glm_config.d_model)
        ids = image_prompt_ids(self.vision_config.num_tokens, self.hparams.prompt)
        if len(ids) + 1 > self.glm_config.max_seq_len:
            raise ValueError(f"the image prompt needs {len(ids) + 1} tokens but the model's max_seq_len is "
                             f"{self.glm_config.max_seq_len}")
        self.register_buffer("prompt_ids", torch.tensor(ids, dtype=torch.long), persistent=False)
        self.register_buffer("digit_ids", torch.tensor(DIGIT_IDS, dtype=torch.long), persistent=False)
        self.image_adapters: ImageTokenAdapters | None = None
        spec = self._image_adapter_spec
        if spec is not None:  # built before the weights load, so a vision checkpoint's adapters load with them
            self.image_adapters = ImageTokenAdapters(self, spec["targets"], width=self.glm_config.d_model,
                                                     rank=spec["rank"], alpha=spec["alpha"])

    def load_stage_weights(self, checkpoint: dict[str, Any], path: str | Path, strict: bool) -> None:
        """The vision encoder's weights when the checkpoint comes from a vision run with the same vision config (and
        the image adapters', when both runs have the same ones)."""
        if "vision_config" not in checkpoint:
            return
        if checkpoint["vision_config"] != self.vision_config.to_dict():
            rank_zero_warn(f"{path}: vision config differs from this run's; the vision encoder starts from scratch")
            return
        saved = checkpoint.get("state_dict", {})
        state = {k.removeprefix("vision."): v for k, v in saved.items() if k.startswith("vision.")}
        self.vision.load_state_dict(state, strict=strict)
        adapters = {k.removeprefix("image_adapters."): v for k, v in saved.items() if k.startswith("image_adapters.")}
        if self.image_adapters is not None and adapters:
            if checkpoint.get("image_adapters") != self._image_adapter_spec:
                rank_zero_warn(f"{path}: image adapters differ from this run's; they start from zero")
            else:
                self.image_adapters.load_state_dict(adapters, strict=strict)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["vision_config"] = self.vision_config.to_dict()
        if self._image_adapter_spec is not None:
            checkpoint["image_adapters"] = self._image_adapter_spec
        if "state_dict" in checkpoint and is_lora_parametrized(self):
            # the plain merged weights load anywhere (init_weights of a later stage); the adapters ride along
            checkpoint["state_dict"], checkpoint["lora_state"] = lora_checkpoint_state(self, checkpoint["state_dict"])

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Resuming an adapted run: put base weights + adapters back in place of the merged weights."""
        if "lora_state" in checkpoint and is_lora_parametrized(self):
            checkpoint["state_dict"] = restore_lora_state(checkpoint["state_dict"], checkpoint["lora_state"])

    def on_fit_end(self) -> None:
        if self.hparams.lora is not None and self.hparams.lora.get("merge_at_end", True):
            merge_lora(self)

    # --- optimisation ---------------------------------------------------------------------------------------------
    def param_groups(self) -> list[dict[str, Any]]:
        """Per-group learning rates when `lr_groups` is set (lr 0 freezes); the shared two groups otherwise."""
        if not self._lr_groups:
            return super().param_groups()
        return build_param_groups(self.named_parameters(), self._lr_groups, self.hparams.lr,
                                  self.hparams.weight_decay)

    def setup(self, stage: str) -> None:
        """Fail before training when the data cannot feed this model (image form, replayed text length)."""
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        hp = getattr(dm, "hparams", {})
        cfg = self.vision_config
        if hp.get("image_size", cfg.image_size) != cfg.image_size or hp.get("channels", cfg.channels) != cfg.channels:
            raise ValueError(f"the data gives [{hp.get('channels')}, {hp.get('image_size')}, {hp.get('image_size')}] "
                             f"images but the vision encoder takes [{cfg.channels}, {cfg.image_size}, "
                             f"{cfg.image_size}]: set data.init_args.channels / image_size or model vision.* to match")
        text = getattr(dm, "text", None)
        if text is not None and text.hparams.seq_len > self.glm_config.max_seq_len:
            raise ValueError(f"text_replay.seq_len {text.hparams.seq_len} exceeds the model's max_seq_len "
                             f"{self.glm_config.max_seq_len}")

    # --- forward --------------------------------------------------------------------------------------------------
    def input_ids(self, batch_size: int, answers: torch.Tensor | None = None) -> torch.Tensor:
        """[B, P] prompt ids, or [B, P+1] with the answer bytes appended (teacher forcing for the eos loss)."""
        ids = self.prompt_ids.unsqueeze(0).expand(batch_size, -1)
        if answers is not None:
            ids = torch.cat((ids, answers.view(-1, 1)), dim=1)
        return ids

    def forward(self, images: torch.Tensor, input_ids: torch.Tensor | None = None) -> Any:
        """GLMOutput of the shared model on `input_ids` (default: the prompt) with the image tokens spliced in."""
        features = self.vision(images)
        if input_ids is None:
            input_ids = self.input_ids(images.shape[0])
        embeds = self.model.embed(input_ids)
        embeds = splice_image_features(embeds, input_ids, features, TOK.image_id)
        if self.image_adapters is None:
            return self.model(input_embeds=embeds)
        with self.image_adapters.active(input_ids == TOK.image_id):
            return self.model(input_embeds=embeds)

    def _step(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        images, labels = batch["image"], batch["label"]
        c = self.vision_config.channels
        if images.dim() == 4 and images.shape[1] != c:
            kind = {1: "grayscale", 3: "RGB"}
            raise ValueError(f"the vision encoder takes {c}-channel ({kind.get(c, '?')}) images but the batch has "
                             f"{images.shape[1]} channels {tuple(images.shape)}: set data.init_args.channels: {c} "
                             f"(or the model's vision.channels to match the data)")
        if labels.dim() != 1 or labels.shape[0] != images.shape[0]:
            raise ValueError(f"labels must be [B] with B = {images.shape[0]}, got {tuple(labels.shape)}")
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= NUM_CLASSES):
            raise ValueError(f"digit labels must lie in 0..9, got [{int(labels.min())}, {int(labels.max())}]")
        answers = self.digit_ids[labels]
        P = self.prompt_ids.numel()
        eos = self.hparams.eos_loss and self.training
        out = self(images, self.input_ids(images.shape[0], answers if eos else None))
        logits = out.logits.float()
        answer_logits = logits[:, P - 1]
        loss = F.cross_entropy(answer_logits, answers)
        if eos:
            loss = loss + F.cross_entropy(logits[:, P], torch.full_like(answers, TOK.eos_id))
        digit_logits = answer_logits[:, self.digit_ids]
        return {"loss": loss, "aux": out.aux_loss, "preds": digit_logits.argmax(-1),
                "probs": digit_logits.softmax(-1), "labels": labels}

    # --- steps ----------------------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        r = self._step(batch)
        self.train_acc(r["preds"], r["labels"])
        loss, aux = r["loss"], r["aux"]
        self.log("train/image_loss", r["loss"], prog_bar=True)
        if "text" in batch:  # replayed pre-training text: next-token loss keeps the language skill in use
            text = batch["text"]
            out = self.model(text["input_ids"])
            text_loss = next_token_loss(out.logits, text["targets"])
            self.log("train/text_loss", text_loss, prog_bar=True)
            loss = loss + self.hparams.text_loss_weight * text_loss
            aux = aux + out.aux_loss
        self.log("train/loss", loss)
        self.log("train/aux_loss", aux)
        self.log("train/acc", self.train_acc, on_step=True, on_epoch=False, prog_bar=True)
        return loss + self.hparams.aux_loss_weight * aux

    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        # once per optimizer step: aux-loss-free MoE balancing, only for layers that are being trained (a frozen
        # language model stays exactly as loaded)
        if self.training:
            for moe in self.model.moe_layers():
                if moe.router_weight.requires_grad:
                    moe.update_balance_bias()

    def _eval_step(self, batch: dict[str, torch.Tensor], batch_idx: int, stage: str) -> dict[str, torch.Tensor]:
        r = self._step(batch)
        acc, loss, confmat = getattr(self, f"{stage}_acc"), getattr(self, f"{stage}_loss"), \
            getattr(self, f"{stage}_confmat")
        acc(r["preds"], r["labels"])
        loss(r["loss"], r["labels"].numel())
        confmat(r["preds"], r["labels"])
        self.log(f"{stage}/acc", acc, prog_bar=True)
        self.log(f"{stage}/loss", loss, prog_bar=stage == "val")
        if batch_idx == 0 and self.hparams.log_images:
            n = self.hparams.log_images
            self._shown[stage] = (batch["image"][:n].detach().cpu(), r["preds"][:n].cpu(), r["labels"][:n].cpu())
        return r

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, batch_idx, "val")

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, batch_idx, "test")

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        images = batch["image"] if isinstance(batch, dict) else batch
        digit_logits = self(images).logits.float()[:, self.prompt_ids.numel() - 1][:, self.digit_ids]
        return {"pred": digit_logits.argmax(-1), "probs": digit_logits.softmax(-1)}

    # --- TensorBoard figures --------------------------------------------------------------------------------------
    def on_validation_epoch_start(self) -> None:
        self.val_confmat.reset()

    def on_test_epoch_start(self) -> None:
        self.test_confmat.reset()

    def on_validation_epoch_end(self) -> None:
        self._log_figures("val")

    def on_test_epoch_end(self) -> None:
        self._log_figures("test")

    def _log_figures(self, stage: str) -> None:
        confmat = getattr(self, f"{stage}_confmat")
        shown = self._shown.pop(stage, None)
        if self.trainer.sanity_checking or not isinstance(self.logger, TensorBoardLogger):
            return
        writer = self.logger.experiment
        import matplotlib.pyplot as plt

        writer.add_figure(f"{stage}/confusion_matrix", confusion_figure(confmat.compute().cpu()), self.global_step)
        if shown is not None:
            images, preds, labels = shown
            dm = getattr(self.trainer, "datamodule", None)
            if dm is not None and hasattr(dm, "denormalize"):
                images = dm.denormalize(images)
            writer.add_figure(f"{stage}/predictions", prediction_grid(images, preds, labels), self.global_step)
        plt.close("all")


def confusion_figure(confmat: torch.Tensor) -> Any:
    """Matplotlib figure of a [10, 10] confusion matrix (rows = true digit, columns = predicted)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.imshow(confmat.numpy(), cmap="Blues")
    k = confmat.shape[0]
    ax.set_xticks(range(k))
    ax.set_yticks(range(k))
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    top = max(1, int(confmat.max()))
    for i in range(k):
        for j in range(k):
            v = int(confmat[i, j])
            if v:
                ax.text(j, i, str(v), ha="center", va="center", fontsize=7,
                        color="white" if v > top / 2 else "black")
    fig.tight_layout()
    return fig


def prediction_grid(images: torch.Tensor, preds: torch.Tensor, labels: torch.Tensor) -> Any:
    """Matplotlib grid of images titled "pred p / true t" (red when wrong). Images [N, C, H, W]; values outside
    [0, 1] are min-max scaled per image."""
    import matplotlib.pyplot as plt

    n = images.shape[0]
    cols = min(8, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(1.3 * cols, 1.5 * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i >= n:
            continue
        img = images[i].float()
        if img.min() < 0 or img.max() > 1:
            img = (img - img.min()) / (img.max() - img.min()).clamp_min(1e-6)
        img = img.permute(1, 2, 0).numpy()
        ax.imshow(img[..., 0] if img.shape[-1] == 1 else img, cmap="gray" if img.shape[-1] == 1 else None)
        ok = int(preds[i]) == int(labels[i])
        ax.set_title(f"pred {int(preds[i])} / true {int(labels[i])}", fontsize=7, color="black" if ok else "red")
    fig.tight_layout()
    return fig


def _adapter_spec(spec: dict[str, Any] | None, arg: str, allowed: set[str], defaults: dict[str, Any],
                  targets: str) -> dict[str, Any] | None:
    """An adapter argument (`lora`, `image_adapters`) with its defaults; errors name the argument and the bad key."""
    if spec is None:
        return None
    if not isinstance(spec, dict) or "targets" not in spec:
        raise ValueError(f"{arg} must be a mapping with `targets` ({targets}), got {spec!r}")
    extra = set(spec) - allowed
    if extra:
        raise ValueError(f"{arg}: unknown key(s) {sorted(extra)}; allowed: {sorted(allowed)}")
    return {**defaults, **spec}


def check_lora(lora: dict[str, Any] | None) -> dict[str, Any] | None:
    """The `lora` argument with its defaults (rank 8, alpha 16, merge_at_end true)."""
    return _adapter_spec(lora, "lora", LORA_KEYS, {"rank": 8, "alpha": 16.0, "merge_at_end": True},
                         "glob patterns of weights")


def check_image_adapters(spec: dict[str, Any] | None) -> dict[str, Any] | None:
    """The `image_adapters` argument with its defaults (rank 16, alpha 16)."""
    return _adapter_spec(spec, "image_adapters", IMAGE_ADAPTER_KEYS, {"rank": 16, "alpha": 16.0},
                         "glob patterns of sublayers such as model.blocks.*.mixer")


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the target positions that are not IGNORE (the pre-training loss)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
