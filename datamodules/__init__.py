"""LightningDataModules (importing this package registers them for `class_path: Name` in configs)."""

from datamodules.code_corpus import CodeCorpusDataModule
from datamodules.digits import DigitsDataModule
from datamodules.rl_prompts import RLPromptDataModule

__all__ = ["CodeCorpusDataModule", "DigitsDataModule", "RLPromptDataModule"]
