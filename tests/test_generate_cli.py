"""`python -m glm_lightning generate`: tokens stream out as they are sampled, task prompts get the verifier's verdict
per sample, and without a prompt every family is sampled."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from glm_lightning.generate_cli import load_model, run, stream_sample
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
    text = stream_sample(model, "def f(x):", 12, 0.0, torch.Generator().manual_seed(0), pieces.append)
    assert "".join(pieces) == text
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


def test_without_a_prompt_every_family_is_sampled(ckpt):
    results = run(["--ckpt", ckpt, "--max_new_tokens", "4"], out=lambda s: None)
    printed_families = {r[0] for r in results}
    assert len(results) == len(family_names()) and len(printed_families) == len(results)
    assert all(len(verdicts) == 1 for _, _, verdicts in results)


def test_precision_bf16_streams_what_the_bf16_copy_generates(ckpt):
    """--precision bf16 samples from the bf16 copy of the weights: the greedy text of the library's cached generation
    with precision="bf16"."""
    from glm_lightning.generation import generate
    from glm_lightning.tokenizer import ByteTokenizer

    pieces: list[str] = []
    results = run(["--ckpt", ckpt, "--prompt", "def f(x):", "--max_new_tokens", "12", "--precision", "bf16"],
                  out=pieces.append)
    tok = ByteTokenizer()
    ids = torch.tensor([tok.encode("def f(x):", bos=True)])
    want = tok.decode(generate(load_model(ckpt), ids, max_new_tokens=12, precision="bf16").tokens[0])
    assert results[0][1] == [want]
