"""The verifier accepts real-world correct code and rejects realistic bugs (issue #15, legitimate corpus).

Each problem in tests/verifier_corpus has a reference solution written the way people write Python, >= 4 tests with
edge cases, and a mutant made by one small edit. All references and all mutants go through one batched
`check_many` call with 2 workers: every reference must be "passed" and every mutant "failed" (it ran and got a test
wrong or raised). The sources are only parsed here (`ast`), never executed in this process.
"""

from __future__ import annotations

import ast
import time
from collections import Counter

import pytest

from glm_lightning.verifier import Verifier
from verifier_corpus import ALL, Problem
from verifier_corpus.problem import problem

MIN_PROBLEMS = 150
MIN_TESTS = 4
MIN_USES = 3  # "each several times": every required construct and module appears in at least this many problems
REQUIRED_MODULES = ("math", "itertools", "collections", "functools", "heapq", "bisect", "re", "string")
REQUIRED_CONSTRUCTS = ("comprehension", "recursion", "class", "generator", "closure")


# -- static structure ----------------------------------------------------------------------------------------------
def _own_names(fn: ast.AST) -> set[str]:
    """Names bound directly in function `fn` (parameters, assignments, imports, nested defs), not in nested scopes."""
    names = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)} if hasattr(fn, "args") else set()
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        stack.extend(ast.iter_child_nodes(node))
    return names


def _captures(inner: ast.AST, outer: ast.AST) -> bool:
    """True when nested function `inner` reads (or declares nonlocal) a name bound in enclosing function `outer`."""
    bound_outside = _own_names(outer) - _own_names(inner)
    for node in ast.walk(inner):
        if isinstance(node, ast.Nonlocal):
            return True
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in bound_outside:
            return True
    return False


def _calls_itself(fn: ast.FunctionDef) -> bool:
    """A direct recursive call: `name(...)` or `self.name(...)` inside the body of `def name`."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id == fn.name:
                return True
            if isinstance(f, ast.Attribute) and f.attr == fn.name and isinstance(f.value, ast.Name) \
                    and f.value.id == "self":
                return True
    return False


def features(source: str) -> set[str]:
    """Which required constructs and modules a source uses, found by parsing it (never by running it)."""
    tree = ast.parse(source)
    found: set[str] = set()
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in ast.walk(tree):
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            found.add("comprehension")
        elif isinstance(node, ast.ClassDef):
            found.add("class")
        elif isinstance(node, (ast.Yield, ast.YieldFrom)):
            found.add("generator")
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    if any(_calls_itself(fn) for fn in functions):
        found.add("recursion")
    for outer in functions:
        for inner in ast.walk(outer):
            if inner is not outer and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and _captures(inner, outer):
                found.add("closure")
    return found


def _defines_function(source: str, name: str) -> bool:
    tree = ast.parse(source)
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


def test_feature_scanner_detects_each_construct():
    """The scanner itself can say no: a plain function has none of the features, each snippet has exactly its own."""
    assert features("def f(x):\n    return x + 1\n") == set()
    assert features("def f(x):\n    def g(y):\n        return y\n    return g(x)\n") == set()  # nested, no capture
    assert features("def f(x):\n    def g():\n        return x\n    return g()\n") == {"closure"}
    assert features("def f(n):\n    return 1 if n < 1 else f(n - 1)\n") == {"recursion"}
    assert features("def f(n):\n    yield n\n") == {"generator"}
    assert features("class A:\n    pass\n") == {"class"}
    assert features("def f(xs):\n    return [x for x in xs]\n") == {"comprehension"}
    assert features("import heapq\nfrom collections import deque\n") == {"heapq", "collections"}


def test_mutant_must_be_exactly_one_edit():
    """A bug text that is absent (mutant == reference) or ambiguous (occurs twice) is a broken corpus entry."""
    p = problem("f", "def f(x):\n    return x + x\n", [((1,), 2)] * 4, ("x + x", "x * x"))
    assert p.mutant == "def f(x):\n    return x * x\n"
    for bug in (("x - x", "x"), ("x", "y")):
        with pytest.raises(ValueError):
            _ = problem("f", p.source, p.tests, bug).mutant


def test_corpus_size_names_and_tests():
    names = [p.name for p in ALL]
    assert len(ALL) >= MIN_PROBLEMS, f"only {len(ALL)} problems"
    assert len(set(names)) == len(names), [n for n, c in Counter(names).items() if c > 1]
    for p in ALL:
        assert p.name.isidentifier(), p.name
        assert len(p.tests) >= MIN_TESTS, f"{p.name}: {len(p.tests)} tests"
        assert all(type(args) is tuple for args, _ in p.tests), p.name
        assert _defines_function(p.source, p.name), f"{p.name}: reference does not define {p.name}()"
        mutant = p.mutant  # raises unless the bug text occurs exactly once
        assert mutant != p.source and _defines_function(mutant, p.name), f"{p.name}: mutant is not a valid edit"


def test_corpus_uses_every_required_construct_and_module():
    uses = Counter(f for p in ALL for f in features(p.source))
    missing = {k: uses[k] for k in REQUIRED_CONSTRUCTS + REQUIRED_MODULES if uses[k] < MIN_USES}
    assert not missing, f"used in fewer than {MIN_USES} problems: {missing}"


# -- through the sandbox -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def verdicts():
    """One batched run: every reference, then every mutant."""
    items = [(p.source, p.name, p.tests) for p in ALL] + [(p.mutant, p.name, p.tests) for p in ALL]
    with Verifier(timeout_s=10.0, memory_mb=256, workers=2) as v:
        started = time.perf_counter()
        results = v.check_many(items)
        elapsed = time.perf_counter() - started
    refs, mutants = results[:len(ALL)], results[len(ALL):]
    print(f"\nverifier corpus: {sum(r.passed for r in refs)}/{len(ALL)} references passed, "
          f"{sum(m.status == 'failed' for m in mutants)}/{len(ALL)} mutants failed, "
          f"{len(items) / elapsed:.0f} verdicts/s ({len(items)} in {elapsed:.2f} s, 2 workers)")
    return refs, mutants


def _report(problems: list[Problem], verdicts: list, want: str) -> list[str]:
    return [f"{p.name}: {v.status} {v.detail}" for p, v in zip(problems, verdicts) if v.status != want]


def test_every_reference_passes(verdicts):
    refs, _ = verdicts
    bad = _report(ALL, refs, "passed")
    assert not bad, "\n".join(bad)


def test_every_mutant_fails(verdicts):
    """"failed" means the mutant ran and got at least one test wrong (not a crash, timeout or syntax error)."""
    _, mutants = verdicts
    bad = _report(ALL, mutants, "failed")
    assert not bad, "\n".join(bad)
    assert all(m.passed_cases < m.total_cases for m in mutants)
