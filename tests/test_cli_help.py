"""`python -m glm_lightning --help` answers without importing torch or Lightning and lists every command;
`fit --help` describes every model and data knob."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from glm_lightning.cli import main
from glm_lightning.model.config import GLMConfig

ROOT = Path(__file__).resolve().parent.parent


def test_top_level_help_is_lazy_and_lists_every_command():
    code = ("import sys; from glm_lightning.cli import main; main(['--help']); "
            "print('HEAVY', [m for m in ('torch', 'lightning', 'jsonargparse') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out
    for command in ("fit", "validate", "test", "demo", "sweep", "generate"):
        assert f"\n  {command} " in out


def test_fit_help_describes_every_model_and_data_knob(capsys, monkeypatch, tmp_path):
    import dataclasses

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    main(["fit", "--help"])  # built, kept in the cache
    text = capsys.readouterr().out
    cached = list((tmp_path / "glm_lightning" / "help").glob("*.txt"))
    assert len(cached) == 1 and cached[0].read_text() == text
    main(["fit", "--help"])  # from the cache: the same text
    assert capsys.readouterr().out == text
    cached[0].write_text("stale")  # the cache is what is printed (the key changes with the code and libraries)
    main(["fit", "--help"])
    assert capsys.readouterr().out == "stale"
    knobs = text[text.index("model and data knobs"):]
    for field in dataclasses.fields(GLMConfig):
        if field.name != "vocab_size":
            assert f" {field.name} (" in " ".join(knobs.split()), field.name
    for section in ("PretrainModule", "RLModule", "StageModule", "CodeCorpusDataModule", "RLPromptDataModule"):
        block = knobs[knobs.index(section):].split("\n\n")[0]
        assert "(no description)" not in block, block
    for knob in ("dev_eval:", "init_weights:", "ordering:", "seq_len:", "warmup_steps:"):
        assert knob in knobs
