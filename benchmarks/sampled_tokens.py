"""The tokens a seeded model samples: 3 presets x (greedy, T 1.0, T 0.35), recorded once and compared after a change
that must not change what the model computes (a refactor, a new fast form).

    python -m benchmarks.sampled_tokens --record benchmarks/sampled_tokens.json   # on the commit before the change
    python -m benchmarks.sampled_tokens --check benchmarks/sampled_tokens.json    # after it: exit 1 on a difference

Each case builds the preset's model from seed 0, prefills two left-padded prompts (long enough for DSA's sparse
regime, and for the tiny preset its long-cache gather) and samples 3 completions of 24 tokens each, 1 thread (a
thread count or a CPU with other vector widths may round differently; the file records the CPU and torch version it
was made on, and a check elsewhere says so instead of comparing).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from glm_lightning.generation import generate
from glm_lightning.model import GLMConfig, GLMModel

PRESETS = ("tiny", "demo", "flash-25m")
MODES = {"greedy": 0.0, "T1.0": 1.0, "T0.35": 0.35}
NEW_TOKENS = 24
SAMPLES = 3


def machine() -> str:
    """What the recorded tokens depend on besides the code: the CPU and torch's version."""
    from glm_lightning.model import cext

    return f"{cext._cpu_model()} | torch {torch.__version__}"


def prompts(cfg: GLMConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, left-padded to one length: ids [2, T] and the bool mask of real tokens."""
    long = min(cfg.max_seq_len - NEW_TOKENS, 90)
    lengths = (long, long // 2)
    g = torch.Generator().manual_seed(1)
    ids = torch.zeros(2, long, dtype=torch.long)
    valid = torch.zeros(2, long, dtype=torch.bool)
    for row, n in enumerate(lengths):
        ids[row, long - n:] = torch.randint(32, 127, (n,), generator=g)
        valid[row, long - n:] = True
    return ids, valid


def sample(preset: str, mode: str) -> list[list[int]]:
    """The completions [2 * SAMPLES][NEW_TOKENS] of one case."""
    torch.manual_seed(0)
    cfg = GLMConfig.preset(preset)
    model = GLMModel(cfg).eval()
    ids, valid = prompts(cfg)
    gen = generate(model, ids, max_new_tokens=NEW_TOKENS, temperature=MODES[mode], num_samples=SAMPLES,
                   eos_id=None, generator=torch.Generator().manual_seed(2), attention_mask=valid)
    return gen.tokens.tolist()


def all_cases() -> dict[str, list[list[int]]]:
    torch.set_num_threads(1)
    return {f"{p}/{m}": sample(p, m) for p in PRESETS for m in MODES}


def compare(recorded: dict, now: dict[str, list[list[int]]]) -> list[str]:
    """The names of the cases whose tokens differ."""
    return [name for name, toks in recorded["cases"].items() if now.get(name) != toks]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--record", type=Path, help="write the tokens of this tree to this JSON file")
    g.add_argument("--check", type=Path, help="compare this tree's tokens with this JSON file")
    args = p.parse_args()
    now = all_cases()
    if args.record:
        args.record.write_text(json.dumps({"machine": machine(), "cases": now}) + "\n")
        print(f"recorded {len(now)} cases to {args.record}")
        return
    recorded = json.loads(args.check.read_text())
    if recorded["machine"] != machine():
        print(f"recorded on another machine ({recorded['machine']}), not comparing")
        return
    bad = compare(recorded, now)
    print(f"same sampled tokens in {len(now) - len(bad)} of {len(recorded['cases'])} cases" +
          (f"; different: {', '.join(bad)}" if bad else ""))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
