"""pass@k: the estimator against brute-force enumeration, the torchmetrics aggregation, and the callback's
per-family/per-role bookkeeping on a tiny model with a stub verifier."""

import itertools
from math import comb
from types import SimpleNamespace

import pytest
import torch

from callbacks.pass_at_k import PassAtKCallback
from glm_lightning.evaluation import gather_sharded, shard
from datamodules.rl_prompts import RLPromptDataModule
from glm_lightning.metrics import PassAtK, pass_at_k
from glm_lightning.model import GLMConfig, GLMModel
from glm_lightning.verifier import Verdict


def brute_force(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (c of them correct) that contain at least one correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_enumeration_over_subsets():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k), abs=1e-12), (n, c, k)
                assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5)  # product form stays exact where binomials are huge
    assert 0.0 <= pass_at_k(1000, 1, 1) <= 1.0


def test_pass_at_k_bad_input():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 8)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="n >= 1"):
        pass_at_k(0, 0, 1)
    with pytest.raises(TypeError):
        pass_at_k(4.0, 1, 1)


def test_metric_aggregates_in_float64_and_merges_like_ddp():
    m = PassAtK(ks=(1, 5))
    assert m.totals.dtype == torch.float64 and m._reductions["totals"].__name__.endswith("sum")
    m.update([10, 10], [1, 0])
    out = m.compute()
    assert out["pass@1"].item() == pytest.approx(0.05) and out["pass@5"].item() == pytest.approx(0.25)
    # two "ranks" with disjoint problems, merged by summing states == one metric over all problems
    a, b, whole = PassAtK(ks=(1, 2)), PassAtK(ks=(1, 2)), PassAtK(ks=(1, 2))
    a.update([4, 4], [1, 3])
    b.update(torch.tensor([4]), torch.tensor([0]))
    whole.update([4, 4, 4], [1, 3, 0])
    a.merge_state(b)
    for key, value in whole.compute().items():
        assert a.compute()[key].item() == pytest.approx(value.item())
    with pytest.raises(ValueError, match="n >= max"):
        PassAtK(ks=(1, 8)).update([4], [1])


def test_shard_and_gather_roundtrip_single_process():
    assert shard([1, 2, 3], None) == [1, 2, 3]
    assert gather_sharded(None, [0.5, 1.0], 2) == [0.5, 1.0]


class StubVerifier:
    """Deterministic fake verdicts: a completion 'passes' when its text hashes even (no code is run)."""

    def check_many(self, jobs):
        return [Verdict("passed" if sum(map(ord, src)) % 2 == 0 else "failed", 0, 1) for src, _, _ in jobs]


@pytest.fixture
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models run far faster on one thread on a shared CPU
    yield
    torch.set_num_threads(old)


def test_callback_logs_overall_family_and_role_values(one_thread):
    torch.manual_seed(0)
    model = GLMModel(GLMConfig.preset("tiny", max_seq_len=192))
    dm = RLPromptDataModule(train_families=["increment"], monitor_families=["square", "reverse"],
                            prompts_per_family=1, eval_per_family=2)
    trainer = SimpleNamespace(datamodule=dm, world_size=1, global_rank=0, sanity_checking=False)
    logged = {}
    module = SimpleNamespace(model=model, verifier=StubVerifier(), device=torch.device("cpu"),
                             log=lambda name, value, **kw: logged.__setitem__(name, value))
    cb = PassAtKCallback(n=4, ks=[1, 2, 4], max_new_tokens=6, temperature=1.0)
    trainer.sanity_checking = True
    cb.on_validation_epoch_end(trainer, module)
    assert not logged  # skipped during the sanity check
    trainer.sanity_checking = False
    cb.on_validation_epoch_end(trainer, module)
    out = cb.last_outcomes
    assert len(out.tasks) == 6 and len(out.correct) == 6 and len(out.greedy) == 6
    for k in (1, 2, 4):
        expect = sum(pass_at_k(4, c, k) for c in out.correct) / 6
        assert logged[f"val/pass@{k}"] == pytest.approx(expect)
    assert logged["val/greedy_pass"] == pytest.approx(sum(out.greedy) / 6)
    fam = [i for i, t in enumerate(out.tasks) if t.family == "square"]
    assert logged["val/pass@2/square"] == pytest.approx(sum(pass_at_k(4, out.correct[i], 2) for i in fam) / 2)
    mon = [i for i, t in enumerate(out.tasks) if t.family != "increment"]
    assert logged["val/greedy_pass/monitor"] == pytest.approx(sum(out.greedy[i] for i in mon) / 4)
    assert "val/pass@4/rewarded" in logged and "val/pass@1/reverse" in logged


def test_evaluate_at_start_logs_the_before_values_and_counts(one_thread):
    torch.manual_seed(0)
    model = GLMModel(GLMConfig.preset("tiny", max_seq_len=192))
    dm = RLPromptDataModule(train_families=["increment"], monitor_families=[], prompts_per_family=1,
                            eval_per_family=3)
    calls = []
    logger = SimpleNamespace(log_metrics=lambda metrics, step: calls.append((step, dict(metrics))))
    trainer = SimpleNamespace(datamodule=dm, world_size=1, global_rank=0, sanity_checking=False, logger=logger,
                              is_global_zero=True, global_step=0)
    module = SimpleNamespace(model=model, verifier=StubVerifier(), device=torch.device("cpu"))
    PassAtKCallback(n=2, ks=[1, 2], max_new_tokens=6, temperature=1.0).on_train_start(trainer, module)
    assert not calls  # off by default
    cb = PassAtKCallback(n=2, ks=[1, 2], max_new_tokens=6, temperature=1.0, greedy=False, prefix="dev",
                         evaluate_at_start=True)
    cb.on_train_start(trainer, module)
    (step, logged), = calls
    out = cb.last_outcomes
    assert step == 0 and logged["start/dev/pass@1"] == logged["dev/pass@1"]
    assert logged["dev/sampled_total"] == 6 and logged["start/dev/sampled_exact"] == sum(out.correct)
    assert logged["dev/pass@1"] == pytest.approx(sum(out.correct) / 6)


def test_start_cache_evaluates_a_shared_start_once_and_only_for_the_same_tasks(one_thread, tmp_path):
    """Arms of a sweep share a start and a seed: the second reads the first one's "before" from the cache and logs
    the same values; other weights, or the same task ids drawn with another data seed (other tasks), evaluate again."""
    torch.manual_seed(0)
    model = GLMModel(GLMConfig.preset("tiny", max_seq_len=192))
    module = SimpleNamespace(model=model, verifier=StubVerifier(), device=torch.device("cpu"))

    def start(seed: int) -> tuple[PassAtKCallback, dict, int]:
        dm = RLPromptDataModule(train_families=["increment"], monitor_families=["square"], prompts_per_family=1,
                                eval_per_family=2, seed=seed)
        calls = []
        trainer = SimpleNamespace(datamodule=dm, world_size=1, global_rank=0, sanity_checking=False,
                                  is_global_zero=True, global_step=0, strategy=SimpleNamespace(
                                      broadcast=lambda obj, src=0: obj),
                                  logger=SimpleNamespace(log_metrics=lambda m, step: calls.append(dict(m))))
        cb = PassAtKCallback(n=2, ks=[1, 2], max_new_tokens=6, temperature=1.0, evaluate_at_start=True,
                             start_cache=str(tmp_path / "cache"))
        evaluated = []
        real = cb.evaluate
        cb.evaluate = lambda tr, pm: evaluated.append(1) or real(tr, pm)
        cb.on_train_start(trainer, module)
        (logged,) = calls
        return cb, logged, len(evaluated)

    first, logged1, n1 = start(seed=0)
    second, logged2, n2 = start(seed=0)
    assert (n1, n2) == (1, 0) and logged2 == logged1 and "start/val/greedy_pass" in logged2
    assert first.start_cached_at is None and second.start_cached_at and second.last_results == first.last_results
    _, _, n3 = start(seed=1)                        # same task ids (split/family/index), other tasks
    assert n3 == 1
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1e-3  # other weights
    _, _, n4 = start(seed=0)
    assert n4 == 1
    assert len(list((tmp_path / "cache").glob("*.json"))) == 3
