"""`python -m glm_lightning generate`: tokens stream out as they are sampled, task prompts get the verifier's verdict
per sample, and without a prompt every family is sampled."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from glm_lightning.generate_cli import run
from glm_lightning.pretrained import load_model, stream_sample
from glm_lightning.model import GLMConfig, GLMModel
from glm_lightning.tasks.families import family_names


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:  # noqa: ANN001
    torch.manual_seed(0)
    cfg = GLMConfig.preset("tiny", max_seq_len=192)
    model = GLMModel(cfg)
    path = Path(tmp_path_factory.mktemp("gen")) / "tiny.ckpt"
    torch.save({"glm_config": cfg.to_dict(), "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}},
               path)
    return str(path)


def test_tokens_stream_one_piece_at_a_time_and_match_the_model(ckpt):
    model = load_model(ckpt)
    pieces: list[str] = []
    sample = stream_sample(model, "def f(x):", 12, 0.0, torch.Generator().manual_seed(0), pieces.append)
    text = sample.text
    assert "".join(pieces) == text
    assert sample.stop == "token limit" and len(sample.tokens) == 12
    assert len([p for p in pieces if p]) >= min(3, len(text))  # several pieces, not one block at the end
    # greedy streaming equals the library's cached generation
    from glm_lightning.generation import generate
    from glm_lightning.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    ids = torch.tensor([tok.encode("def f(x):", bos=True)])
    assert tok.decode(generate(model, ids, max_new_tokens=12).tokens[0]) == text


def test_task_prompt_prints_a_verdict_per_sample(ckpt):
    out: list[str] = []
    results = run(["--ckpt", ckpt, "--task", "increment", "--num_samples", "3", "--temperature", "1.0",
                   "--max_new_tokens", "16"], out=out.append)
    (prompt, samples, verdicts), = results
    assert "def " in prompt and len(samples) == len(verdicts) == 3
    printed = "".join(out)
    assert printed.count("verdict ") == 3 and all(v.status in printed for v in verdicts)
    assert "[increment] increment_" in printed and printed.count("sample 3/3") == 1


def test_free_prompt_has_no_verdict(ckpt):
    out: list[str] = []
    (prompt, samples, verdicts), = run(["--ckpt", ckpt, "--prompt", "hello", "--max_new_tokens", "4"],
                                       out=out.append)
    assert prompt == "hello" and len(samples) == 1 and verdicts == []
    assert "verdict" not in "".join(out)


def test_without_a_prompt_the_trained_families_are_sampled_and_tallied(ckpt):
    from glm_lightning.tasks.families import CLASSIC_FAMILIES

    out: list[str] = []
    results = run(["--ckpt", ckpt, "--max_new_tokens", "4"], out=out.append)
    assert len(results) == len(CLASSIC_FAMILIES), "a checkpoint that names no families: the 8 classic ones"
    assert all(len(verdicts) == 1 for _, _, verdicts in results)
    table = "".join(out).split("\nfamily")[-1]
    assert all(f"\n{f} " in table for f in CLASSIC_FAMILIES) and "\ntotal " in table
    passed = sum(v.status == "passed" for _, _, verdicts in results for v in verdicts)
    assert re.search(rf"\ntotal +{passed}/{len(CLASSIC_FAMILIES)} ", table), table


def test_families_all_samples_every_registered_family(ckpt):
    results = run(["--ckpt", ckpt, "--max_new_tokens", "2", "--families", "all"], out=lambda s: None)
    assert len(results) == len(family_names()) and len({r[0] for r in results}) == len(results)


def test_the_checkpoints_own_families_are_the_default():
    from glm_lightning.generate_cli import trained_families

    rl = {"data": {"train_families": ["absolute", "double"], "monitor_families": ["increment"]}}
    assert trained_families(rl)[0] == ["absolute", "double", "increment"]
    pretrain = {"data": {"corpus": "functions", "families": ["reverse", "square"]}}
    assert trained_families(pretrain)[0] == ["reverse", "square"]


def test_a_bare_signature_is_wrapped_in_the_training_header_and_every_sample_says_why_it_stopped(ckpt, capsys):
    from glm_lightning.pretrained import as_training_prompt
    from glm_lightning.tasks.task import PROMPT_HEADER

    out: list[str] = []
    (prompt, samples, _), = run(["--ckpt", ckpt, "--prompt", "def double(x):", "--max_new_tokens", "5"],
                                out=out.append)
    assert prompt == f"{PROMPT_HEADER}\n# Double.\ndef double(x):"
    assert "wrapped in the training header" in capsys.readouterr().err
    assert "[stopped: token limit]" in "".join(out)
    (raw, _, _), = run(["--ckpt", ckpt, "--prompt", "def double(x):", "--max_new_tokens", "2", "--raw"],
                       out=lambda s: None)
    assert raw == "def double(x):"
    assert as_training_prompt("# Twice x.\ndef double(x):")[0] == f"{PROMPT_HEADER}\n# Twice x.\ndef double(x):"
    assert as_training_prompt("hello") == ("hello", False)
    assert as_training_prompt(prompt) == (prompt, False), "a prompt in the training format is left alone"


def test_precision_bf16_streams_what_the_bf16_copy_generates(ckpt):
    """--precision bf16 samples from the bf16 copy of the weights: the greedy text of the library's cached generation
    with precision="bf16"."""
    from glm_lightning.generation import generate
    from glm_lightning.tokenizer import ByteTokenizer

    pieces: list[str] = []
    results = run(["--ckpt", ckpt, "--prompt", "def f(x):", "--raw", "--max_new_tokens", "12", "--precision", "bf16"],
                  out=pieces.append)
    tok = ByteTokenizer()
    ids = torch.tensor([tok.encode("def f(x):", bos=True)])
    want = tok.decode(generate(load_model(ckpt), ids, max_new_tokens=12, precision="bf16").tokens[0])
    assert results[0][1] == [want]
