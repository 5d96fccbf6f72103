"""LightningDataModules (importing this package registers them for `class_path: Name` in configs)."""

from datamodules.code_corpus import CodeCorpusDataModule

__all__ = ["CodeCorpusDataModule"]
