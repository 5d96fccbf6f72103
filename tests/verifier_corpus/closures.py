"""Functions that build functions: closures over state, decorators, and `functools` (partial, wraps, caching)."""

from __future__ import annotations

from . import oracles
from .problem import problem

PROBLEMS = [
    problem("counter_values", r"""
        def make_counter(start):
            count = start

            def step():
                nonlocal count
                count += 1
                return count

            return step


        def counter_values(start, calls):
            step = make_counter(start)
            return [step() for _ in range(calls)]
        """,
        [((0, 3), [1, 2, 3]), ((5, 0), []), ((-2, 2), [-1, 0]), ((10, 1), [11])],
        ("count += 1", "count + 1")),
    problem("apply_multipliers", r"""
        def multipliers(n):
            return [lambda x, k=k: x * k for k in range(n)]


        def apply_multipliers(n, x):
            return [f(x) for f in multipliers(n)]
        """,
        [((3, 2), [0, 2, 4]), ((0, 5), []), ((1, 7), [0]), ((4, 1), [0, 1, 2, 3])],
        ("lambda x, k=k: x * k", "lambda x: x * k")),
    problem("tribonacci", r"""
        def memoize(fn):
            cache = {}

            def wrapper(n):
                if n not in cache:
                    cache[n] = fn(n)
                return cache[n]

            return wrapper


        @memoize
        def tribonacci(n):
            if n < 3:
                return [0, 0, 1][n]
            return tribonacci(n - 1) + tribonacci(n - 2) + tribonacci(n - 3)
        """,
        [((n,), oracles.tribonacci(n)) for n in (0, 2, 3, 4, 10, 30, 60)],
        ("[0, 0, 1][n]", "[0, 1, 1][n]")),
    problem("pipeline", r"""
        from functools import reduce

        OPS = {"inc": lambda x: x + 1, "double": lambda x: x * 2, "square": lambda x: x * x, "neg": lambda x: -x}


        def compose(*fns):
            return reduce(lambda f, g: lambda x: f(g(x)), fns, lambda x: x)


        def pipeline(names, x):
            return compose(*(OPS[n] for n in names))(x)
        """,
        [((["inc", "double"], 3), 7), (([], 5), 5), ((["square", "neg"], 3), 9), ((["neg", "square"], 3), -9),
         ((["double", "double", "inc"], 1), 8)],
        ("f(g(x))", "g(f(x))")),
    problem("transform_all", r"""
        from functools import partial


        def scale_and_shift(x, scale, shift):
            return x * scale + shift


        def transform_all(xs, scale, shift):
            f = partial(scale_and_shift, scale=scale, shift=shift)
            return list(map(f, xs))
        """,
        [(([1, 2, 3], 2, 1), [3, 5, 7]), (([], 5, 5), []), (([0], 0, 9), [9]), (([-1, 1], -1, 0), [1, -1])],
        ("x * scale + shift", "(x + shift) * scale")),
    problem("largest_number", r"""
        from functools import cmp_to_key


        def largest_number(nums):
            def compare(a, b):
                if a + b > b + a:
                    return -1
                if a + b < b + a:
                    return 1
                return 0

            digits = sorted(map(str, nums), key=cmp_to_key(compare))
            result = "".join(digits)
            return "0" if result.startswith("0") else result
        """,
        [(([10, 2],), "210"), (([3, 30, 34, 5, 9],), "9534330"), (([0, 0],), "0"), (([1],), "1"),
         (([121, 12],), "12121")],
        ('return "0" if result.startswith("0") else result', "return result")),
    problem("sort_versions", r"""
        from functools import total_ordering


        @total_ordering
        class Version:
            def __init__(self, text):
                self.parts = tuple(int(p) for p in text.split("."))

            def __eq__(self, other):
                return self.parts == other.parts

            def __lt__(self, other):
                return self.parts < other.parts


        def sort_versions(versions):
            return [sorted(versions, key=Version), max(versions, key=Version)]
        """,
        [((["1.10", "1.2", "1.9"],), [["1.2", "1.9", "1.10"], "1.10"]), ((["0.1"],), [["0.1"], "0.1"]),
         ((["2.0", "1.0.5", "1.0"],), [["1.0", "1.0.5", "2.0"], "2.0"]),
         ((["3.0.1", "3.0.0", "3"],), [["3", "3.0.0", "3.0.1"], "3.0.1"])],
        ("int(p)", "p")),
    problem("climb_stairs", r"""
        from functools import lru_cache


        def climb_stairs(n, steps):
            steps = tuple(steps)

            @lru_cache(maxsize=None)
            def ways(k):
                if k == 0:
                    return 1
                return sum(ways(k - s) for s in steps if s <= k)

            return ways(n)
        """,
        [((n, steps), oracles.stair_ways(n, steps)) for n, steps in
         ((4, [1, 2]), (0, [1]), (3, [2]), (10, [1, 3, 5]), (5, [1, 2, 3]), (40, [1, 2]))],
        ("s <= k", "s < k")),
    problem("describe", r"""
        from functools import singledispatch


        @singledispatch
        def describe(x):
            return "other"


        @describe.register
        def _(x: int):
            return "negative int" if x < 0 else "int"


        @describe.register
        def _(x: str):
            return f"str of {len(x)}"


        @describe.register
        def _(x: list):
            return "list of " + ", ".join(describe(item) for item in x)
        """,
        [((5,), "int"), ((-1,), "negative int"), ((0,), "int"), (("abc",), "str of 3"),
         (([1, "a", []],), "list of int, str of 1, list of "), ((None,), "other"), ((2.5,), "other")],
        ("x < 0", "x <= 0")),
    problem("log_messages", r"""
        def make_logger():
            history = []

            def log(msg, level="info"):
                if level not in ("info", "warn", "error"):
                    raise ValueError(level)
                history.append(f"[{level}] {msg}")
                return len(history)

            def dump():
                return list(history)

            return log, dump


        def log_messages(entries):
            log, dump = make_logger()
            for msg, level in entries:
                try:
                    log(msg, level)
                except ValueError:
                    pass
            return dump()
        """,
        [(([("start", "info"), ("oops", "error")],), ["[info] start", "[error] oops"]), (([],), []),
         (([("x", "debug")],), []), (([("a", "warn"), ("b", "bad"), ("c", "info")],), ["[warn] a", "[info] c"])],
        ('("info", "warn", "error")', '("info", "error")')),
    problem("fib_call_count", r"""
        import functools


        def count_calls(fn):
            @functools.wraps(fn)
            def wrapper(*args):
                wrapper.calls += 1
                return fn(*args)

            wrapper.calls = 0
            return wrapper


        def fib_call_count(n):
            @count_calls
            def fib(k):
                return k if k < 2 else fib(k - 1) + fib(k - 2)

            value = fib(n)
            return [value, fib.calls]
        """,
        [((0,), [0, 1]), ((1,), [1, 1]), ((2,), [1, 3]), ((5,), [5, 15]), ((10,), [55, 177])],
        ("k < 2", "k < 1")),
    problem("validate_all", r"""
        import re


        def make_validator(pattern):
            compiled = re.compile(pattern)

            def validate(s):
                return compiled.fullmatch(s) is not None

            return validate


        def validate_all(pattern, items):
            check = make_validator(pattern)
            return [check(s) for s in items]
        """,
        [((r"\d{3}-\d{4}", ["555-1234", "5551234", "555-12345"]), [True, False, False]), (("a+", []), []),
         (("[a-c]*", ["", "abc", "abd"]), [True, True, False]), (("x|y", ["x", "xy"]), [True, False])],
        ("fullmatch", "match")),
    problem("make_accumulators", r"""
        def make_accumulator():
            total = 0

            def add(x):
                nonlocal total
                total += x
                return total

            return add


        def make_accumulators(streams):
            accs = [make_accumulator() for _ in streams]
            return [[acc(x) for x in stream] for acc, stream in zip(accs, streams)]
        """,
        [(([[1, 2, 3], [10]],), [[1, 3, 6], [10]]), (([],), []), (([[]],), [[]]),
         (([[5, -5], [1, 1]],), [[5, 0], [1, 2]])],
        ("    total = 0\n", "    total = 1\n")),
    problem("retry_until", r"""
        def make_flaky(failures):
            attempts = 0

            def call():
                nonlocal attempts
                attempts += 1
                if attempts <= failures:
                    raise ConnectionError(f"attempt {attempts}")
                return attempts

            return call


        def retry_until(failures, max_tries):
            call = make_flaky(failures)
            for _ in range(max_tries):
                try:
                    return call()
                except ConnectionError:
                    continue
            return -1
        """,
        [((0, 3), 1), ((2, 3), 3), ((3, 3), -1), ((5, 10), 6), ((1, 0), -1)],
        ("attempts <= failures", "attempts < failures")),
    problem("bucket_by", r"""
        from functools import reduce


        def bucket_by(words, key_name):
            keys = {"first": lambda w: w[:1], "length": len, "last": lambda w: w[-1:]}
            key = keys[key_name]

            def add(buckets, word):
                buckets.setdefault(key(word), []).append(word)
                return buckets

            return reduce(add, words, {})
        """,
        [((["apple", "avocado", "banana"], "first"), {"a": ["apple", "avocado"], "b": ["banana"]}),
         (([], "length"), {}), ((["hi", "yo", "hey"], "length"), {2: ["hi", "yo"], 3: ["hey"]}),
         ((["ab", "cb", ""], "last"), {"b": ["ab", "cb"], "": [""]})],
        ('"last": lambda w: w[-1:]', '"last": lambda w: w[-2:]')),
]
