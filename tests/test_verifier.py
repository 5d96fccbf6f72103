"""Functional tests of the sandboxed verifier: correct/incorrect solutions, exact types, bad input, health.

Hostile candidates live in test_verifier_hostile.py. One module-scoped Verifier is shared to keep this fast.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from glm_lightning.verifier import Verdict, Verifier

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def verifier():
    with Verifier(timeout_s=2.0, memory_mb=256, workers=2) as v:
        yield v


def fn(body: str, name: str = "f", args: str = "x") -> str:
    """Source of a one-function candidate; `body` lines are indented automatically."""
    lines = "\n".join("    " + line for line in body.strip("\n").split("\n"))
    return f"def {name}({args}):\n{lines}\n"


# --------------------------------------------------------------------------------------------------------------
# Task families: (family, entry point, params, correct body, wrong body, tests). Own copies of small reference
# solutions; each wrong body is a plausible bug that must fail at least one test.
# --------------------------------------------------------------------------------------------------------------
FAMILIES = [
    ("increment", "x", "return x + 1", "return x + 2", [((-3,), -2), ((0,), 1), ((7,), 8), ((99,), 100), ((-1,), 0)]),
    ("double", "x", "return x * 2", "return x ** 2", [((0,), 0), ((1,), 2), ((-4,), -8), ((5,), 10), ((2,), 4)]),
    ("square", "x", "return x * x", "return x * 2", [((0,), 0), ((3,), 9), ((-4,), 16), ((2,), 4), ((11,), 121)]),
    ("absolute", "x", "return x if x >= 0 else -x", "return x", [((0,), 0), ((5,), 5), ((-5,), 5), ((-1,), 1),
                                                                  ((12,), 12)]),
    ("nonnegative", "x", "return x >= 0", "return int(x >= 0)", [((0,), True), ((3,), True), ((-2,), False),
                                                                  ((-1,), False), ((10,), True)]),
    ("even", "x", "return x % 2 == 0", "return x % 2", [((0,), True), ((1,), False), ((4,), True), ((-3,), False),
                                                         ((10,), True)]),
    ("reverse", "s", "return s[::-1]", "return s", [(("abc",), "cba"), (("",), ""), (("a",), "a"),
                                                     (("ab",), "ba"), (("hello",), "olleh")]),
    ("list_sum", "xs", "return sum(xs)", "return sum(xs[1:])", [(([],), 0), (([1, 2, 3],), 6), (([-1, 1],), 0),
                                                                  (([5],), 5), (([2, 2, 2, 2],), 8)]),
    ("decrement", "x", "return x - 1", "return x + 1", [((0,), -1), ((5,), 4), ((-3,), -4), ((100,), 99),
                                                         ((1,), 0)]),
    ("triple", "x", "return 3 * x", "return x * 2", [((0,), 0), ((1,), 3), ((-2,), -6), ((5,), 15), ((33,), 99)]),
    ("halve", "x", "return x // 2", "return x / 2", [((0,), 0), ((7,), 3), ((8,), 4), ((-7,), -4), ((-1,), -1)]),
    ("sign", "x", "return (x > 0) - (x < 0)", "return 1 if x > 0 else -1",
     [((5,), 1), ((-3,), -1), ((0,), 0), ((1,), 1), ((-100,), -1)]),
    ("clamp", "x, lo, hi", "return max(lo, min(x, hi))", "return min(x, hi)",
     [((5, 0, 10), 5), ((-5, 0, 10), 0), ((15, 0, 10), 10), ((3, 3, 3), 3), ((-1, -4, -2), -2)]),
    ("max_of_two", "a, b", "return a if a >= b else b", "return a",
     [((1, 2), 2), ((3, 1), 3), ((-1, -1), -1), ((0, -5), 0), ((-7, 4), 4)]),
    ("min_of_list", "xs", "return min(xs)", "return xs[0]",
     [(([3, 1, 2],), 1), (([5],), 5), (([-1, -9, 0],), -9), (([2, 2],), 2), (([7, 8, 6],), 6)]),
    ("count_vowels", "s", "return sum(1 for c in s.lower() if c in 'aeiou')", "return sum(c in 'aeiou' for c in s)",
     [(("hello",), 2), (("",), 0), (("AEIOU",), 5), (("xyz",), 0), (("Banana",), 3)]),
    ("is_palindrome", "s", "return s == s[::-1]", "return s[0] == s[-1] if s else True",
     [(("racecar",), True), (("ab",), False), (("",), True), (("abca",), False), (("noon",), True)]),
    ("first_char", "s", "return s[0]", "return s[:2]", [(("abc",), "a"), (("z",), "z"), (("hello",), "h"),
                                                         (("  x",), " "), (("Q!",), "Q")]),
    ("list_length", "xs", "return len(xs)", "return len(xs) - 1", [(([],), 0), (([1],), 1), (([1, 2, 3],), 3),
                                                                     ((["a", "b"],), 2), (([[]],), 1)]),
    ("to_upper", "s", "return s.upper()", "return s.capitalize()", [(("abc",), "ABC"), (("",), ""),
                                                                     (("Hello World",), "HELLO WORLD"),
                                                                     (("x1y",), "X1Y"), (("ABC",), "ABC")]),
    ("concat_twice", "s", "return s + s", "return s * 3", [(("ab",), "abab"), (("",), ""), (("x",), "xx"),
                                                            (("hi!",), "hi!hi!"), (("  ",), "    ")]),
    ("divisible_by_three", "x", "return x % 3 == 0", "return x % 3", [((0,), True), ((3,), True), ((4,), False),
                                                                       ((-9,), True), ((10,), False)]),
]
FAMILY_IDS = [family[0] for family in FAMILIES]


@pytest.fixture(scope="module")
def family_verdicts(verifier):
    """All correct and all wrong reference solutions in one parallel batch."""
    items = []
    for name, params, good, bad, tests in FAMILIES:
        items.append((fn(good, name, params), name, tests))
        items.append((fn(bad, name, params), name, tests))
    verdicts = verifier.check_many(items)
    return {name: (verdicts[2 * i], verdicts[2 * i + 1]) for i, (name, *_rest) in enumerate(FAMILIES)}


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_family_correct_solution_passes(family_verdicts, family):
    verdict = family_verdicts[family][0]
    assert verdict.status == "passed", verdict.detail
    assert verdict.passed and verdict.passed_cases == verdict.total_cases == 5 and verdict.fraction == 1.0


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_family_wrong_solution_fails(family_verdicts, family):
    verdict = family_verdicts[family][1]
    assert verdict.status == "failed", verdict.detail
    assert not verdict.passed and verdict.passed_cases < verdict.total_cases == 5


# --------------------------------------------------------------------------------------------------------------
# Counting and exact-type comparison
# --------------------------------------------------------------------------------------------------------------
def test_partial_correctness_counts(verifier):
    tests = [((3,), 3), ((0,), 0), ((-2,), 2), ((7,), 7), ((-5,), 5)]
    verdict = verifier.check(fn("return x"), "f", tests)  # right for non-negative inputs only
    assert (verdict.status, verdict.passed_cases, verdict.total_cases) == ("failed", 3, 5)
    assert verdict.fraction == pytest.approx(0.6)
    assert "f(-2) returned -2, expected 2" in verdict.detail


def test_exception_in_one_case_counts_as_failure_of_that_case(verifier):
    verdict = verifier.check(fn("return 10 // x"), "f", [((1,), 10), ((0,), 0), ((5,), 2)])
    assert (verdict.status, verdict.passed_cases) == ("failed", 2)
    assert "ZeroDivisionError" in verdict.detail


@pytest.mark.parametrize(
    "body, expected",
    [
        ("return 1", True),  # int where bool expected
        ("return True", 1),  # bool where int expected
        ("return 1.0", 1),  # float where int expected
        ("return 1", 1.0),  # int where float expected
        ("return [1, 2]", (1, 2)),  # list vs tuple
        ("return (1, 2)", [1, 2]),  # tuple vs list
        ("return [1, True]", [1, 1]),  # nested bool vs int
        ("return {1: 'a'}", {True: "a"}),  # dict key type
        ("return {'a': 1}", {"a": 1.0}),  # dict value type
        ("return b'a'", "a"),  # bytes vs str
        ("return None", 0),
        ("return ''", None),
        ("return 0", False),
    ],
)
def test_type_strictness(verifier, body, expected):
    verdict = verifier.check(fn(body), "f", [((0,), expected)])
    assert verdict.status == "failed", (body, expected, verdict)


@pytest.mark.parametrize(
    "body, expected",
    [
        ("return [1, [2, 'x'], (None, 1.5)]", [1, [2, "x"], (None, 1.5)]),
        ("return (1, 'a', [True, False])", (1, "a", [True, False])),
        ("return {'a': [1, 2], 3: (None,)}", {3: (None,), "a": [1, 2]}),
        ("return None", None),
        ("return 'h\\u00e9llo \\u2603 \\n\\t\"'", "h\u00e9llo \u2603 \n\t\""),
        ("return 2 ** 100", 2**100),
        ("return -(2 ** 5000)", -(2**5000)),  # beyond the int->str digit limit
        ("return float('inf')", math.inf),
        ("return float('nan')", math.nan),
        ("return 0.1 + 0.2", 0.1 + 0.2),
        ("return b'\\x00\\xff'", b"\x00\xff"),
        ("return {}", {}),
        ("return ()", ()),
    ],
)
def test_value_kinds_round_trip(verifier, body, expected):
    verdict = verifier.check(fn(body), "f", [((0,), expected)])
    assert verdict.status == "passed", verdict.detail


def test_inputs_reach_the_candidate_with_exact_types(verifier):
    source = fn("return [type(a).__name__ for a in args]", args="*args")
    args = (1, True, 1.0, "s", None, [1], (1,), {"k": 1}, b"b")
    verdict = verifier.check(source, "f", [(args, ["int", "bool", "float", "str", "NoneType", "list", "tuple",
                                                   "dict", "bytes"])])
    assert verdict.status == "passed", verdict.detail


def test_mutating_inputs_does_not_affect_other_cases(verifier):
    source = fn("xs.append(0)\nreturn len(xs)", args="xs")
    verdict = verifier.check(source, "f", [(([1, 2],), 3), (([1, 2],), 3)])
    assert verdict.status == "passed", verdict.detail


# --------------------------------------------------------------------------------------------------------------
# Legal code must never be rejected by the sandbox
# --------------------------------------------------------------------------------------------------------------
LEGAL = [
    ("loops_and_comprehensions", "def f(n):\n    out = []\n    for i in range(n):\n        out.append(i * i)\n"
                                 "    return [v for v in out if v % 2 == 0] + list({i for i in range(2)})\n",
     [((5,), [0, 4, 16, 0, 1])]),
    ("recursion", "def f(n):\n    return 1 if n <= 1 else n * f(n - 1)\n", [((10,), 3628800)]),
    ("deepish_recursion", "def f(n):\n    return 0 if n == 0 else 1 + f(n - 1)\n", [((900,), 900)]),
    ("sorted_and_strings", "def f(s):\n    return ' '.join(sorted(s.split(), key=str.lower)).strip().title()\n",
     [(("b a C",), "A B C")]),
    ("math_and_re", "import math\nimport re\n\ndef f(s):\n    return math.isqrt(len(re.findall(r'\\d', s)))\n",
     [(("a1b2c3d4",), 2)]),
    ("helpers_and_classes", "class Acc:\n    def __init__(self):\n        self.t = 0\n\n    def add(self, v):\n"
                            "        self.t += v\n        return self\n\n\ndef _helper(v):\n    return v * 2\n\n\n"
                            "def f(xs):\n    a = Acc()\n    for x in xs:\n        a.add(_helper(x))\n"
                            "    return a.t\n", [(([1, 2, 3],), 12)]),
    ("collections_functools_itertools", "from collections import Counter, namedtuple, deque\n"
                                        "from functools import lru_cache, reduce\nimport itertools\n"
                                        "P = namedtuple('P', 'a b')\n\n@lru_cache(maxsize=None)\ndef fib(n):\n"
                                        "    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\ndef f(s):\n"
                                        "    c = Counter(s).most_common(1)[0][0]\n    d = deque([1, 2])\n"
                                        "    return (c, fib(30), reduce(lambda a, b: a + b, d), P(1, 2).b,\n"
                                        "            list(itertools.accumulate([1, 2, 3])))\n",
     [(("aab",), ("a", 832040, 3, 2, [1, 3, 6]))]),
    ("dataclass_typing_enum", "from dataclasses import dataclass\nfrom typing import List, Optional, TypeVar\n"
                              "import enum\nT = TypeVar('T')\n\nclass Color(enum.Enum):\n    RED = 1\n\n"
                              "@dataclass\nclass Pt:\n    x: int\n    y: Optional[int] = None\n\n"
                              "def f(xs: List[int]) -> int:\n    return Pt(sum(xs)).x + Color.RED.value\n",
     [(([1, 2],), 4)]),
    ("non_preloaded_stdlib_imports", "import hashlib, fractions, decimal, statistics, json, random, string, heapq\n"
                                     "def f(s):\n    random.seed(0)\n    return (hashlib.sha256(s.encode()).hexdigest()[:8],"
                                     " str(fractions.Fraction(1, 3) * 3), statistics.median([3, 1, 2]),"
                                     " json.loads(json.dumps([1])), heapq.nsmallest(1, [5, 4]))\n",
     [(("a",), ("ca978112", "1", 2, [1], [4]))]),
    ("submodule_of_preloaded_package", "import json.tool\nimport collections.abc\ndef f(s):\n"
                                       "    return s.encode('cp1252').decode('cp1252') + json.tool.__name__\n",
     [(("caf\u00e9",), "caf\u00e9json.tool")]),
    ("exceptions_inside", "def f(x):\n    try:\n        return int(x)\n    except ValueError as e:\n"
                          "        return type(e).__name__\n", [(("12",), 12), (("zz",), "ValueError")]),
    ("generators_lambdas_print", "def f(n):\n    print('debug', n)\n    g = (i for i in range(n))\n"
                                 "    sq = lambda v: v * v\n    return sum(map(sq, g))\n", [((4,), 14)]),
    ("scratch_file_in_workdir", "import os, tempfile\ndef f(s):\n    with open('scratch.txt', 'w') as fh:\n"
                                "        fh.write(s)\n    with tempfile.TemporaryDirectory() as d:\n"
                                "        pass\n    with open('scratch.txt') as fh:\n        return fh.read() * 2\n",
     [(("ab",), "abab")]),
    ("nested_function_and_closure", "def f(n):\n    def make(k):\n        return lambda v: v + k\n"
                                    "    return make(n)(1)\n", [((1,), 2)]),
    ("module_level_constants", "TABLE = {c: i for i, c in enumerate('abc')}\n\ndef f(s):\n"
                               "    return [TABLE[c] for c in s]\n", [(("cab",), [2, 0, 1])]),
    ("isinstance_and_type", "def f(x):\n    return isinstance(x, int) and type(x) is int\n", [((3,), True)]),
    ("star_import_and_pathlib", "from os import *\nfrom pathlib import Path\n\ndef f(x):\n"
                                "    Path('notes.txt').write_text(str(x))\n"
                                "    return sep + Path('notes.txt').read_text()\n", [((1,), "/1")]),
    ("main_guard_not_run", "def f(x):\n    return x\n\nif __name__ == '__main__':\n    raise SystemExit(1)\n",
     [((1,), 1)]),
]


@pytest.mark.parametrize("name, source, tests", LEGAL, ids=[case[0] for case in LEGAL])
def test_legal_code_passes(verifier, name, source, tests):
    verdict = verifier.check(source, "f", tests)
    assert verdict.status == "passed", f"{name}: {verdict.detail}"


# --------------------------------------------------------------------------------------------------------------
# invalid / error / timeout classification
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "source, entry",
    [
        ("def f(x)\n    return x\n", "f"),  # syntax error
        ("", "f"),  # empty
        ("def g(x):\n    return x\n", "f"),  # wrong name
        ("f = 3\n", "f"),  # not a function
        ("f = len\n", "f"),  # builtin, not a Python function
        ("class f:\n    pass\n", "f"),  # a class
        ("f = lambda x: x\n\0", "f"),  # NUL byte
        ("def f(x):\n\treturn x\n        return x\n", "f"),  # inconsistent indentation
    ],
)
def test_invalid(verifier, source, entry):
    verdict = verifier.check(source, entry, [((1,), 1)])
    assert verdict.status == "invalid", verdict
    assert verdict.passed_cases == 0 and verdict.total_cases == 1


def test_lambda_counts_as_function(verifier):
    assert verifier.check("f = lambda x: x + 1\n", "f", [((1,), 2)]).status == "passed"


def test_crash_at_import_is_error(verifier):
    verdict = verifier.check("raise RuntimeError('boom')\ndef f(x):\n    return x\n", "f", [((1,), 1)])
    assert verdict.status == "error" and "RuntimeError" in verdict.detail


def test_memory_error_is_error(verifier):
    verdict = verifier.check(fn("return len(bytearray(10 ** 10))"), "f", [((1,), 1)])
    assert verdict.status == "error" and "MemoryError" in verdict.detail


def test_timeout_reports_partial_progress():
    with Verifier(timeout_s=1.0, workers=1) as v:
        source = fn("import time\nif x == 3:\n    while True:\n        pass\ntime.sleep(0.06)\nreturn x")
        verdict = v.check(source, "f", [((1,), 1), ((2,), 2), ((3,), 3), ((4,), 4)])
    assert verdict.status == "timeout"
    assert verdict.passed_cases == 2 and verdict.total_cases == 4
    assert 1.0 <= verdict.elapsed_s < 2.0


# --------------------------------------------------------------------------------------------------------------
# The sandbox environment (positive controls: what a candidate can observe)
# --------------------------------------------------------------------------------------------------------------
def test_child_environment_is_minimal(verifier):
    source = fn("import os, sys\nreturn (sorted(os.environ), os.listdir('.'), os.getcwd() != start,"
                " sys.stdin.read())", args="start")
    verdict = verifier.check(source, "f", [((os.getcwd(),), (["HOME", "TMPDIR"], [], True, ""))])
    assert verdict.status == "passed", verdict.detail


@pytest.mark.skipif(os.geteuid() != 0, reason="uid drop only happens when the verifier runs as root")
def test_child_runs_unprivileged(verifier):
    """Each job runs as its own uid from the server's leased block (issue 46), never root, with no groups."""
    first, count = verifier.protections["per_job_uid"]
    source = fn(f"import os\nu = os.getuid()\nreturn (u == os.geteuid() and {first} <= u < {first + count},"
                " os.getgroups())")
    verdict = verifier.check(source, "f", [((0,), (True, []))])
    assert verdict.status == "passed", verdict.detail


def test_protections_are_reported(verifier):
    protections = verifier.protections
    json.dumps(protections)  # plain data, loggable
    for key in ("launcher", "network_namespace", "pid_namespace", "unprivileged_uid", "nproc_enforced", "rlimits",
                "audit_hook", "wall_clock_timeout_s", "process_group_kill"):
        assert key in protections
    assert protections["audit_hook"] is True and protections["expected_values_in_child"] is False
    if os.geteuid() == 0:  # as root we must not run candidates as root
        assert protections["unprivileged_uid"] not in (None, 0)
        assert protections["nproc_enforced"] is True


# --------------------------------------------------------------------------------------------------------------
# Bad input: a clear exception in the caller, never a hang
# --------------------------------------------------------------------------------------------------------------
GOOD_SOURCE = fn("return x")


@pytest.mark.parametrize(
    "source, entry, tests, error",
    [
        (None, "f", [((1,), 1)], TypeError),
        (b"def f(x): return x", "f", [((1,), 1)], TypeError),
        (GOOD_SOURCE, None, [((1,), 1)], TypeError),
        (GOOD_SOURCE, 3, [((1,), 1)], TypeError),
        (GOOD_SOURCE, "", [((1,), 1)], ValueError),
        (GOOD_SOURCE, "1f", [((1,), 1)], ValueError),
        (GOOD_SOURCE, "f; import os", [((1,), 1)], ValueError),
        (GOOD_SOURCE, "class", [((1,), 1)], ValueError),
        (GOOD_SOURCE, "f", [], ValueError),
        (GOOD_SOURCE, "f", None, TypeError),
        (GOOD_SOURCE, "f", "((1,), 1)", TypeError),
        (GOOD_SOURCE, "f", [(1, 1)], TypeError),  # args not a tuple
        (GOOD_SOURCE, "f", [([1], 1)], TypeError),
        (GOOD_SOURCE, "f", [((1,),)], TypeError),  # not a pair
        (GOOD_SOURCE, "f", [((1,), 1, 2)], TypeError),
        (GOOD_SOURCE, "f", [((1,), {1, 2})], TypeError),  # set not serialisable
        (GOOD_SOURCE, "f", [((1,), object())], TypeError),
        (GOOD_SOURCE, "f", [(({1},), 1)], TypeError),  # bad argument value
        (GOOD_SOURCE, "f", [((1,), 1), ((lambda: 0,), 1)], TypeError),
        ("x" * 300_000, "f", [((1,), 1)], ValueError),
    ],
)
def test_bad_input_raises(verifier, source, entry, tests, error):
    start = time.monotonic()
    with pytest.raises(error):
        verifier.check(source, entry, tests)
    assert time.monotonic() - start < 1.0


def test_bad_items_in_check_many(verifier):
    with pytest.raises(TypeError):
        verifier.check_many([(GOOD_SOURCE, "f")])
    with pytest.raises(TypeError):
        verifier.check_many("not a list")
    with pytest.raises(TypeError):  # one bad item rejects the whole batch before anything runs
        verifier.check_many([(GOOD_SOURCE, "f", [((1,), 1)]), (GOOD_SOURCE, "f", [((1,), set())])])
    assert verifier.check_many([]) == []


@pytest.mark.parametrize("kwargs", [{"timeout_s": 0}, {"timeout_s": -1}, {"timeout_s": float("nan")},
                                    {"memory_mb": 1}, {"workers": 0}, {"workers": 1.5}, {"timeout_s": "2"}])
def test_bad_constructor_arguments(kwargs):
    with pytest.raises(ValueError):
        Verifier(**kwargs)


# --------------------------------------------------------------------------------------------------------------
# Verdict, determinism, parallelism, lifecycle
# --------------------------------------------------------------------------------------------------------------
def test_verdict_dataclass():
    verdict = Verdict("failed", 3, 4, "x", elapsed_s=0.5)
    assert verdict.fraction == 0.75 and not verdict.passed
    assert Verdict("passed", 2, 2).passed and Verdict("error", 0, 0).fraction == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        verdict.status = "passed"  # type: ignore[misc]
    assert verdict == Verdict("failed", 3, 4, "x", elapsed_s=9.0)  # timing is not part of equality
    with pytest.raises(ValueError):
        Verdict("maybe", 0, 1)  # type: ignore[arg-type]


def test_deterministic(verifier):
    cases = [(fn("return x + 1"), "f", [((1,), 2), ((2,), 4)]), (fn("return 1 // x"), "f", [((0,), 0)]),
             ("def f(:\n", "f", [((1,), 1)]), (fn("import os\nos.system('true')"), "f", [((1,), 1)])]
    first = verifier.check_many(cases)
    second = [verifier.check(*case) for case in cases]
    assert first == second
    assert [v.status for v in first] == ["failed", "failed", "invalid", "error"]


def test_check_many_preserves_order(verifier):
    items = [(fn(f"return {i}"), "f", [((0,), i if i % 3 else -1)]) for i in range(30)]
    verdicts = verifier.check_many(items)
    assert [v.passed for v in verdicts] == [bool(i % 3) for i in range(30)]


def test_concurrent_callers_are_serialised_safely(verifier):
    results: dict[int, list] = {}

    def worker(k: int) -> None:
        results[k] = verifier.check_many([(fn(f"return x + {k}"), "f", [((1,), 1 + k)])] * 5)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(v.passed for k in range(3) for v in results[k])


def test_healthy_after_timeout_and_fork_bomb():
    with Verifier(timeout_s=1.0, workers=1) as v:
        assert v.check(fn("while True:\n    pass"), "f", [((1,), 1)]).status == "timeout"
        assert v.check(fn("import os\nwhile True:\n    try:\n        os.fork()\n    except Exception:\n"
                          "        pass"), "f", [((1,), 1)]).status in ("timeout", "error")
        assert v.check(fn("return x"), "f", [((1,), 1)]).status == "passed"


def test_recovers_when_a_sandbox_server_dies():
    """Kill the zygote mid-job: that job becomes an error, queued jobs are re-run, later calls still work."""
    with Verifier(timeout_s=2.0, workers=1) as v:
        launcher = v._pool.zygotes[0].proc.pid
        children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
        target = int(children[0]) if children else launcher  # the zygote itself (inside unshare, if used)
        timer = threading.Timer(0.5, os.kill, (target, 9))
        timer.start()
        slow = fn("import time\ntime.sleep(1.5)\nreturn x")
        verdicts = v.check_many([(slow, "f", [((1,), 1)]), (fn("return x"), "f", [((2,), 2)])])
        timer.join()
        assert verdicts[0].status == "error" and "sandbox" in verdicts[0].detail
        assert verdicts[1].status == "passed"
        assert v.check(fn("return x"), "f", [((3,), 3)]).passed


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_close_stops_processes_and_removes_scratch():
    v = Verifier(timeout_s=1.0, workers=2)
    pids = [z.proc.pid for z in v._pool.zygotes]
    scratch = v._pool.scratch
    assert all(_alive(pid) for pid in pids) and os.path.isdir(scratch)
    with v:
        assert v.check(fn("return x"), "f", [((1,), 1)]).passed
    assert v.closed
    assert not any(_alive(pid) for pid in pids)
    assert not os.path.exists(scratch)
    v.close()  # idempotent
    with pytest.raises(RuntimeError):
        v.check(fn("return x"), "f", [((1,), 1)])


def test_no_leak_at_interpreter_exit(tmp_path):
    """A script that never calls close() must not leave sandbox processes or scratch directories behind."""
    script = (
        "import json, sys\n"
        "from glm_lightning.verifier import Verifier\n"
        "v = Verifier(timeout_s=5.0, workers=2)\n"
        "print(json.dumps({'pids': [z.proc.pid for z in v._pool.zygotes], 'scratch': v._pool.scratch}))\n"
        "sys.stdout.flush()\n"
        "v.check_many([('def f(x):\\n    return x\\n', 'f', [((1,), 1)])])\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout.splitlines()[0])
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in info["pids"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in info["pids"])
    assert not os.path.exists(info["scratch"])


def test_verifier_package_does_not_import_torch():
    code = "import sys, glm_lightning.verifier as v; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
