"""Tests for glm_lightning.tasks: registry, reference bodies (run in a subprocess), splits, pools, composition."""

from __future__ import annotations

import ast
import itertools
import json
import subprocess
import sys

import pytest

from glm_lightning.tasks.composition import (
    OPS,
    CompositionTask,
    composition_structures,
    make_composition_examples,
    split_structures,
)
from glm_lightning.tasks.families import (
    CLASSIC_FAMILIES,
    FAMILIES,
    HELD_OUT_FAMILIES,
    KINDS,
    PRETRAIN_FAMILIES,
    RL_FAMILIES,
    family_names,
    get_family,
    resolve_families,
)
from glm_lightning.tasks.task import (
    MAX_PROMPT_BYTES,
    MAX_TEXT_BYTES,
    SPLITS,
    Task,
    build_task,
    iter_train_tasks,
    make_pool,
    make_task,
    make_tasks,
    split_of_name,
    values_match,
)
from glm_lightning.tasks.composition import MAX_TEXT_BYTES as COMPOSITION_MAX_TEXT_BYTES
from glm_lightning.tasks.families import fill

# ---------------------------------------------------------------------------------------------------------------
# Running programs: all sources are concatenated into ONE module and run by ONE isolated `python -I` child, which calls
# each entry point on its test arguments and prints JSON. The test process never runs generated code itself.
# ---------------------------------------------------------------------------------------------------------------

_DRIVER = """
import json as _json
_out = []
for _name, _args in _json.loads(_CASES):
    try:
        _r = globals()[_name](*_args)
        _out.append({"type": type(_r).__name__, "repr": repr(_r), "value": _r})
    except BaseException as _e:
        _out.append({"error": type(_e).__name__ + ": " + str(_e)})
print(_json.dumps(_out))
"""


def run_programs(programs: list[tuple[str, str, list[tuple[tuple, object]]]]) -> list[list[dict]]:
    """programs: (source, entry_point, tests). Returns per program, per test, the child's result record."""
    calls = [(entry, list(args)) for _, entry, tests in programs for args, _ in tests]
    module = "\n\n".join(source for source, _, _ in programs)
    script = module + "\n\n_CASES = " + repr(json.dumps(calls)) + "\n" + _DRIVER
    # the script goes in on stdin (`python -I -`): a `-c` argument is capped at 128 KiB by the kernel
    proc = subprocess.run([sys.executable, "-I", "-"], input=script, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    flat = json.loads(proc.stdout)
    assert len(flat) == len(calls)
    out, pos = [], 0
    for _, _, tests in programs:
        out.append(flat[pos : pos + len(tests)])
        pos += len(tests)
    return out


def result_ok(record: dict, expected: object) -> bool:
    if "error" in record:
        return False
    return record["type"] == type(expected).__name__ and record["repr"] == repr(expected)


# ---------------------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------------------


def _exact_json_type(value: object) -> bool:
    if type(value) in (int, bool, str, type(None)):
        return True
    if type(value) is list:
        return all(_exact_json_type(v) for v in value)
    return False


def test_registry_size_and_classics():
    assert len(FAMILIES) >= 22
    assert len(CLASSIC_FAMILIES) == 8
    assert set(CLASSIC_FAMILIES) <= set(FAMILIES)
    required = {
        "decrement", "triple", "halve", "sign", "clamp", "max_of_two", "min_of_list", "count_vowels",
        "is_palindrome", "first_char", "list_length", "to_upper", "concat_twice", "divisible_by_three",
    }
    assert required <= set(FAMILIES)
    assert set(RL_FAMILIES) <= set(CLASSIC_FAMILIES)
    assert set(HELD_OUT_FAMILIES) <= set(FAMILIES)
    assert not set(HELD_OUT_FAMILIES) & set(PRETRAIN_FAMILIES)
    assert set(HELD_OUT_FAMILIES) | set(PRETRAIN_FAMILIES) == set(FAMILIES)
    assert family_names() == tuple(FAMILIES)


def test_every_family_is_well_formed():
    with_two_bodies = 0
    difficulties = set()
    for name, family in FAMILIES.items():
        assert family.name == name
        assert len(family.descriptions) >= 3, name
        assert len(family.tests) >= 5, name
        assert len(family.arg_names) >= 2, name
        for position in range(family.arity):
            assert len({choice[position] for choice in family.arg_names}) >= 2, (name, position)
        assert family.kind in KINDS and family.difficulty in (1, 2, 3)
        difficulties.add(family.difficulty)
        with_two_bodies += len(family.bodies) >= 2
        assert len(set(family.bodies)) == len(family.bodies), name
        assert len(set(family.descriptions)) == len(family.descriptions), name
        for description in family.descriptions:
            assert "\n" not in description
        # at least one paraphrase mentions every argument
        for p in family.params:
            assert any("{" + p + "}" in d for d in family.descriptions), (name, p)
        for body in family.bodies:
            assert "return" in body
            for p in family.params:
                assert "{" + p + "}" in body, (name, body)
        inputs = set()
        for args, expected in family.tests:
            assert type(args) is tuple and len(args) == family.arity
            assert all(_exact_json_type(a) for a in args), (name, args)
            assert _exact_json_type(expected), (name, expected)
            assert json.loads(json.dumps(expected)) == expected
            assert {"int": int, "str": str, "list": list, "bool": bool}[family.kind] is type(expected), (name, expected)
            inputs.add(json.dumps(args))
        assert len(inputs) == len(family.tests), f"{name}: duplicate test inputs"
    assert with_two_bodies >= 18
    assert difficulties == {1, 2, 3}


def test_bool_families_distinguish_true_from_one():
    assert values_match(True, True) and not values_match(1, True) and not values_match(True, 1)
    assert not values_match(0, False) and values_match([1, 2], [1, 2]) and not values_match([1, True], [1, 1])
    assert not values_match((1, 2), [1, 2]) and not values_match(1.0, 1)
    for name in family_names(kind="bool"):
        assert all(type(expected) is bool for _, expected in FAMILIES[name].tests)
        # both outcomes are tested
        assert {expected for _, expected in FAMILIES[name].tests} == {True, False}, name


def test_get_family_and_resolution_errors():
    assert get_family("increment").name == "increment"
    with pytest.raises(ValueError, match="increment"):
        get_family("no_such_family")
    assert resolve_families(None) == tuple(FAMILIES)
    assert resolve_families("increment, double,increment") == ("increment", "double")
    with pytest.raises(ValueError):
        resolve_families(["increment", "bogus"])
    with pytest.raises(ValueError):
        resolve_families([])
    with pytest.raises(ValueError):
        family_names(kind="float")
    easy = family_names(max_difficulty=1)
    assert easy and all(FAMILIES[n].difficulty == 1 for n in easy) and len(easy) < len(FAMILIES)


def test_fill_substitutes_only_known_placeholders():
    assert fill("return {x} + {y} {z}", {"x": "a", "y": "b"}) == "return a + b {z}"


# ---------------------------------------------------------------------------------------------------------------
# Reference bodies really pass (one subprocess for everything)
# ---------------------------------------------------------------------------------------------------------------


def _all_reference_tasks() -> list[Task]:
    """Every (arg choice x body) for every family, plus sampled identities from every split."""
    tasks = []
    for name, family in FAMILIES.items():
        for arg_index, body_index in itertools.product(range(len(family.arg_names)), range(len(family.bodies))):
            tasks.append(
                build_task(
                    name,
                    f"{name}_ref_{arg_index}_{body_index}",
                    arg_index=arg_index,
                    body_index=body_index,
                    description_index=(arg_index + body_index) % len(family.descriptions),
                )
            )
    for split in SPLITS:
        tasks.extend(make_tasks(split, 2, seed=3))
    return tasks


def test_every_reference_body_passes_and_wrong_bodies_fail():
    tasks = _all_reference_tasks()
    wrong = [
        Task(family="increment", name="increment_wrongaa", description="x", args=("x",), body="return x + 2"),
        Task(family="even", name="even_wrongaa", description="x", args=("x",), body="return x % 2"),  # int, not bool
        Task(family="reverse", name="reverse_wrongaa", description="t", args=("text",), body="return text"),
        Task(family="list_sum", name="list_sum_wrongaa", description="v", args=("values",), body="return len(values)"),
        Task(family="halve", name="halve_wrongaa", description="x", args=("x",), body="return int(x / 2)"),
        Task(family="first_char", name="first_char_wrongaa", description="t", args=("s",), body="return s[0]"),
    ]
    programs = [(t.source(), t.entry_point, list(t.tests)) for t in tasks + wrong]
    results = run_programs(programs)
    names = set()
    for task, records in zip(tasks, results):
        assert task.name not in names
        names.add(task.name)
        for (args, expected), record in zip(task.tests, records):
            assert result_ok(record, expected), (task.name, task.body, args, expected, record)
    for task, records in zip(wrong, results[len(tasks) :]):
        assert not all(result_ok(r, e) for r, (_, e) in zip(records, task.tests)), task.name
    # every body of every family and every argument-name choice was covered
    covered = {(t.family, t.arg_index, t.body_index) for t in tasks}
    expected_cover = {
        (n, a, b) for n, f in FAMILIES.items() for a in range(len(f.arg_names)) for b in range(len(f.bodies))
    }
    assert expected_cover <= covered


def test_every_identity_fits_the_length_budget():
    longest_prompt = longest_text = 0
    for name, family in FAMILIES.items():
        for a, b, d in itertools.product(
            range(len(family.arg_names)), range(len(family.bodies)), range(len(family.descriptions))
        ):
            task = build_task(name, name + "_abcdefg", arg_index=a, body_index=b, description_index=d)
            longest_prompt = max(longest_prompt, len(task.prompt.encode("utf-8")))
            longest_text = max(longest_text, len(task.text.encode("utf-8")))
    assert longest_prompt <= MAX_PROMPT_BYTES and longest_text <= MAX_TEXT_BYTES, (longest_prompt, longest_text)
    train, held = split_structures()
    examples = make_composition_examples(train + held, 2000, seed=0)
    assert max(len(e.text.encode("utf-8")) for e in examples) <= COMPOSITION_MAX_TEXT_BYTES


def test_sources_parse_and_have_one_def():
    for task in _all_reference_tasks():
        tree = ast.parse(task.source())
        assert len(tree.body) == 1 and isinstance(tree.body[0], ast.FunctionDef)
        assert tree.body[0].name == task.entry_point
        assert [a.arg for a in tree.body[0].args.args] == list(task.args)
        assert "{" not in task.prompt and "{" not in task.completion, task.text


# ---------------------------------------------------------------------------------------------------------------
# Task format
# ---------------------------------------------------------------------------------------------------------------


def test_prompt_and_completion_format_exact():
    task = build_task("increment", "increment_qkzvwhp", description_index=0, arg_index=0, body_index=0)
    assert task.prompt == "# Complete this Python function.\n# Return x plus one.\ndef increment_qkzvwhp(x):"
    assert task.completion == "\n    return x + 1\n"
    assert task.text == task.prompt + task.completion == task.source()
    assert task.source("\n    return 7\n") == task.prompt + "\n    return 7\n"
    assert task.entry_point == "increment_qkzvwhp"
    assert task.task_id == "custom/increment/0"

    two = build_task("max_of_two", "max_of_two_abcdefg", arg_index=1, body_index=1, description_index=0)
    assert two.prompt == "# Complete this Python function.\n# Return the larger of x and y.\ndef max_of_two_abcdefg(x, y):"
    assert two.completion == "\n    return max(x, y)\n"

    multi = build_task("list_sum", "list_sum_abcdefg", arg_index=0, body_index=1)
    assert multi.completion == "\n    t = 0\n    for v in values:\n        t += v\n    return t\n"

    record = task.to_dict()
    assert json.loads(json.dumps(record)) == record
    assert record["tests"][0] == [[-3], -2]


def test_task_names_ids_and_fields():
    tasks = make_tasks("dev", 3, seed=0)
    assert len(tasks) == 3 * len(FAMILIES)
    for i, task in enumerate(tasks):
        family = FAMILIES[task.family]
        assert task.family == list(FAMILIES)[i // 3] and task.index == i % 3
        assert task.task_id == f"dev/{task.family}/{task.index}"
        prefix, suffix = task.name.rsplit("_", 1)
        assert prefix == task.family and len(suffix) == 7 and suffix.isalpha() and suffix.islower()
        assert split_of_name(task.name) == "dev"
        assert task.description in [family.render_description(d, task.arg_index) for d in range(len(family.descriptions))]
        assert task.args == family.arg_names[task.arg_index]
        assert task.body == family.render_body(task.body_index, task.arg_index)
        assert task.tests == family.tests
        hash(task)
    assert len({t.task_id for t in tasks}) == len(tasks)
    assert len({t.name for t in tasks}) == len(tasks)


def test_with_body_keeps_identity():
    task = make_task("train", "double", 0)
    for k in range(len(FAMILIES["double"].bodies)):
        other = task.with_body(k)
        assert (other.name, other.description, other.args, other.task_id) == (task.name, task.description, task.args, task.task_id)
        assert other.body == FAMILIES["double"].render_body(k, task.arg_index)


# ---------------------------------------------------------------------------------------------------------------
# Splits
# ---------------------------------------------------------------------------------------------------------------


def test_splits_deterministic_and_prefix_stable():
    a = make_tasks("confirm", 4, ["increment", "even", "clamp"], seed=5)
    b = make_tasks("confirm", 4, ["increment", "even", "clamp"], seed=5)
    assert a == b
    small = make_tasks("confirm", 2, ["increment", "even", "clamp"], seed=5)
    assert small == [t for t in a if t.index < 2]
    assert make_tasks("confirm", 4, ["increment", "even", "clamp"], seed=6) != a
    # independent of which other families are requested
    assert make_tasks("confirm", 4, ["even"], seed=5) == [t for t in a if t.family == "even"]


def test_splits_are_stable_across_processes_and_hash_seeds():
    code = (
        "import json; from glm_lightning.tasks import make_tasks; "
        "print(json.dumps([t.text for t in make_tasks('rl', 2, ['increment', 'reverse'], seed=1)]))"
    )
    outputs = []
    for hash_seed in ("1", "2"):
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            env={"PYTHONHASHSEED": hash_seed, "PATH": "/usr/bin:/bin"},
            cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]),
        )
        assert proc.returncode == 0, proc.stderr
        outputs.append(json.loads(proc.stdout))
    assert outputs[0] == outputs[1] == [t.text for t in make_tasks("rl", 2, ["increment", "reverse"], seed=1)]


def test_splits_disjoint_names():
    names = {split: {t.name for t in make_tasks(split, 12, seed=0)} for split in SPLITS}
    for split in SPLITS:
        assert len(names[split]) == 12 * len(FAMILIES)  # >= 300 per split
        assert all(split_of_name(n) == split for n in names[split])
    for s1, s2 in itertools.combinations(SPLITS, 2):
        assert not names[s1] & names[s2], (s1, s2)
    # also across seeds and against the training stream
    stream = {t.name for t in itertools.islice(iter_train_tasks(seed=1), 2000)}
    other_seed = {t.name for split in ("dev", "rl", "confirm") for t in make_tasks(split, 5, seed=1)}
    assert not stream & (names["dev"] | names["rl"] | names["confirm"] | other_seed)
    # the bucket rule is a fixed partition: each split owns about a quarter of all names
    counts = {s: 0 for s in SPLITS}
    for i in range(4000):
        counts[split_of_name(f"increment_{i:07d}")] += 1
    assert all(800 < c < 1200 for c in counts.values()), counts


def test_unknown_split_and_family_raise():
    with pytest.raises(ValueError, match="dev"):
        make_tasks("final", 1)
    with pytest.raises(ValueError):
        make_task("test", "increment", 0)
    with pytest.raises(ValueError, match="increment"):
        make_tasks("dev", 1, ["nope"])
    with pytest.raises(ValueError):
        make_pool("holdout", None, 4)
    with pytest.raises(ValueError):
        next(iter_train_tasks(["nope"]))
    with pytest.raises(ValueError):
        make_tasks("dev", -1)


# ---------------------------------------------------------------------------------------------------------------
# Training stream and pools
# ---------------------------------------------------------------------------------------------------------------


def test_train_stream_deterministic_balanced_and_varies_bodies():
    fams = ["increment", "double", "even", "reverse"]
    a = list(itertools.islice(iter_train_tasks(fams, seed=3), 400))
    b = list(itertools.islice(iter_train_tasks(fams, seed=3), 400))
    assert a == b
    assert [t.text for t in itertools.islice(iter_train_tasks(fams, seed=4), 400)] != [t.text for t in a]
    for r in range(0, 400, 4):
        assert sorted(t.family for t in a[r : r + 4]) == sorted(fams)
    assert all(t.split == "train" and split_of_name(t.name) == "train" for t in a)
    assert len({t.task_id for t in a}) == 400
    assert len({t.name for t in a}) >= 398
    for fam in fams:
        used = {t.body_index for t in a if t.family == fam}
        assert used == set(range(len(FAMILIES[fam].bodies))), fam
    fixed = list(itertools.islice(iter_train_tasks(fams, seed=3, vary_body=False), 40))
    assert all(t == make_task("train", t.family, t.index, 3) for t in fixed)


def test_pools_size_nesting_and_cycling():
    fams = ["increment", "double", "square", "even"]
    small = make_pool("train", fams, 8, seed=2)
    big = make_pool("train", fams, 88, seed=2)
    assert len(small) == 8 and len(big) == 88
    assert big[:8] == small
    assert len({t.name for t in big}) == 88
    assert make_pool("train", fams, 8, seed=2) == small
    assert [t.family for t in big[:8]] == fams * 2
    by_tasks = make_tasks("train", 22, fams, seed=2)
    assert set(big) == set(by_tasks)

    for pool_size, pool in ((8, small), (88, big)):
        stream = list(itertools.islice(iter_train_tasks(fams, seed=2, pool_size=pool_size), pool_size * 5))
        identities = {(t.name, t.description, t.args) for t in stream}
        assert identities == {(t.name, t.description, t.args) for t in pool}
        # every epoch is a permutation of the pool
        for e in range(5):
            epoch = stream[e * pool_size : (e + 1) * pool_size]
            assert sorted(t.name for t in epoch) == sorted(t.name for t in pool)
        assert stream == list(itertools.islice(iter_train_tasks(fams, seed=2, pool_size=pool_size), pool_size * 5))
    with pytest.raises(ValueError):
        make_pool("train", fams, 0)


# ---------------------------------------------------------------------------------------------------------------
# Composition corpus
# ---------------------------------------------------------------------------------------------------------------


def safe_arith(expression: str, x: int) -> int:
    """Evaluate the canonical expression grammar (x, ints, + - *, unary -, abs()) by walking its AST."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Name) and node.id == "x":
            return x
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.BinOp):
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "abs"
            and len(node.args) == 1
            and not node.keywords
        ):
            return abs(walk(node.args[0]))
        raise ValueError(f"unsupported node {ast.dump(node)}")

    return walk(ast.parse(expression, mode="eval"))


def test_composition_structures_and_split():
    structures = composition_structures()
    assert len(structures) == 120 == len(set(structures))
    assert all(len(s) == 3 and len(set(s)) >= 2 and set(s) <= set(OPS) for s in structures)
    assert len(composition_structures(min_distinct=1)) == 125
    train, held = split_structures()
    assert len(train) == 88 and len(held) == 32
    assert not set(train) & set(held) and set(train) | set(held) == set(structures)
    assert split_structures() == (train, held)
    assert split_structures(seed=1) != (train, held)
    assert len(split_structures(n_train=100)[1]) == 20
    with pytest.raises(ValueError):
        split_structures(n_train=120)


def test_composition_prompt_format_and_evaluate():
    task = CompositionTask(structure=("add", "neg", "mul"), constants=(3, None, 2), instructions=("add 3.", "negate.", "multiply by 2."))
    assert task.prompt == "Task: start with x. add 3. negate. multiply by 2.\nPython: "
    assert task.completion == "((-(x + 3)) * 2)\n"
    assert task.evaluate(1) == -8 and task.evaluate(-3) == 0
    assert task.group == "add"
    train, held = split_structures()
    examples = make_composition_examples(train, 300, seed=4) + make_composition_examples(held, 64, seed=5)
    for ex in examples:
        assert ex.text == ex.prompt + ex.completion and ex.completion.endswith("\n")
        assert ex.prompt.startswith("Task: start with x. ") and ex.prompt.endswith("\nPython: ")
        assert len(ex.instructions) == 3
        for op, c in zip(ex.structure, ex.constants):
            assert (c in (2, 3, 4, 5)) if op in ("add", "sub", "mul") else c is None
        for x in (-7, -2, 0, 1, 5, 11):
            assert safe_arith(ex.completion.strip(), x) == ex.evaluate(x)
    # a wrong expression is caught (negative control)
    assert any(safe_arith("(x + 1)", x) != examples[0].evaluate(x) for x in (-3, 0, 4))


def test_composition_expression_in_subprocess():
    train, _ = split_structures()
    examples = make_composition_examples(train, 40, seed=9)
    xs = [-5, 0, 3]
    script = "import json\nprint(json.dumps([" + ", ".join(f"[(lambda x: {e.expression})(v) for v in {xs}]" for e in examples) + "]))"
    proc = subprocess.run([sys.executable, "-I", "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [[e.evaluate(v) for v in xs] for e in examples]


def test_composition_holdout_pool_and_determinism():
    train, held = split_structures(seed=0)
    examples = make_composition_examples(train, 500, seed=1)
    assert not {e.structure for e in examples} & set(held)
    assert {e.structure for e in examples} == set(train)
    assert make_composition_examples(train, 500, seed=1) == examples
    assert make_composition_examples(train, 500, seed=2) != examples
    assert [e.structure for e in examples[:88]] == train  # interleaved round-robin
    assert len({e.text for e in examples}) > 400

    small = make_composition_examples(train, 480, seed=1, pool_size=8)
    assert {e.structure for e in small} == set(train[:8])
    assert small[:8] == examples[:8]

    plain = make_composition_examples(train, 20, seed=1, paraphrase=False)
    assert all(e.prompt.split(". ", 1)[1].split(".")[0] in ("add 2", "add 3", "add 4", "add 5", "subtract 2", "subtract 3",
                                                           "subtract 4", "subtract 5", "multiply by 2", "multiply by 3",
                                                           "multiply by 4", "multiply by 5", "negate", "take the absolute value")
               for e in plain)
    with pytest.raises(ValueError):
        make_composition_examples(train, 10, pool_size=0)
    with pytest.raises(ValueError):
        make_composition_examples([("add", "pow", "neg")], 1)
