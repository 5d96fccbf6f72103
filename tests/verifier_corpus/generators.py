"""Lazy sequences: generator functions, `yield from`, coroutines via send, and `itertools` pipelines."""

from __future__ import annotations

import itertools

from . import oracles
from .problem import problem

TREE = (5, (3, (2, None, None), (4, None, None)), (7, None, (8, None, None)))  # in-order: 2 3 4 5 7 8

PROBLEMS = [
    problem("first_fibs", r"""
        from itertools import islice


        def fib_gen():
            a, b = 0, 1
            while True:
                yield a
                a, b = b, a + b


        def first_fibs(n):
            return list(islice(fib_gen(), n))
        """,
        [((0,), []), ((1,), [0]), ((5,), [0, 1, 1, 2, 3]), ((10,), [0, 1, 1, 2, 3, 5, 8, 13, 21, 34])],
        ("yield a", "yield b")),
    problem("batches", r"""
        def batched(iterable, n):
            batch = []
            for item in iterable:
                batch.append(item)
                if len(batch) == n:
                    yield batch
                    batch = []
            if batch:
                yield batch


        def batches(xs, n):
            return list(batched(xs, n))
        """,
        [(([1, 2, 3, 4, 5], 2), [[1, 2], [3, 4], [5]]), (([], 3), []), (([1, 2], 2), [[1, 2]]),
         (("abc", 1), [["a"], ["b"], ["c"]])],
        ("            batch = []", "            batch.clear()")),
    problem("sliding_sums", r"""
        from collections import deque


        def windows(xs, k):
            window = deque(maxlen=k)
            for x in xs:
                window.append(x)
                if len(window) == k:
                    yield tuple(window)


        def sliding_sums(xs, k):
            return [sum(w) for w in windows(xs, k)]
        """,
        [(([1, 2, 3, 4], 2), [3, 5, 7]), (([1, 2], 3), []), (([5], 1), [5]), (([1, 1, 1, 1], 4), [4]), (([], 1), [])],
        ("deque(maxlen=k)", "deque(maxlen=k + 1)")),
    problem("nth_primes", r"""
        from itertools import count, islice


        def primes():
            composites = {}
            for n in count(2):
                if n not in composites:
                    yield n
                    composites[n * n] = [n]
                else:
                    for p in composites.pop(n):
                        composites.setdefault(n + p, []).append(p)


        def nth_primes(k):
            return list(islice(primes(), k))
        """,
        [((k,), oracles.primes(200)[:k]) for k in (0, 1, 5, 25, 46)],
        ("count(2)", "count(1)")),
    problem("flatten_deep", r"""
        def iter_flat(x):
            if isinstance(x, (list, tuple)):
                for item in x:
                    yield from iter_flat(item)
            else:
                yield x


        def flatten_deep(x):
            return list(iter_flat(x))
        """,
        [(([1, [2, (3, [4])], 5],), [1, 2, 3, 4, 5]), (([],), []), ((7,), [7]), (([[], [[[]]]],), []),
         ((["ab", ["c"]],), ["ab", "c"])],
        ("(list, tuple)", "list")),
    problem("running_sum_and_max", r"""
        from itertools import accumulate


        def running_sum_and_max(xs):
            return [list(accumulate(xs)), list(accumulate(xs, max))]
        """,
        [(([1, 3, 2],), [[1, 4, 6], [1, 3, 3]]), (([],), [[], []]), (([-1, -2],), [[-1, -3], [-1, -1]]),
         (([5],), [[5], [5]])],
        ("accumulate(xs, max)", "accumulate(xs, min)")),
    problem("is_strictly_increasing", r"""
        from itertools import pairwise


        def is_strictly_increasing(xs):
            return all(a < b for a, b in pairwise(xs))
        """,
        [(([1, 2, 3],), True), (([],), True), (([1],), True), (([1, 1],), False), (([3, 2],), False),
         (([1, 5, 9, 20],), True)],
        ("a < b", "a <= b")),
    problem("consecutive_runs", r"""
        from itertools import groupby


        def consecutive_runs(nums):
            runs = []
            for _, group in groupby(enumerate(nums), key=lambda p: p[1] - p[0]):
                values = [v for _, v in group]
                runs.append(values[0] if len(values) == 1 else [values[0], values[-1]])
            return runs
        """,
        [(([1, 2, 3, 5, 7, 8],), [[1, 3], 5, [7, 8]]), (([],), []), (([4],), [4]), (([1, 3, 5],), [1, 3, 5]),
         (([-2, -1, 0],), [[-2, 0]])],
        ("p[1] - p[0]", "p[1] + p[0]")),
    problem("count_combos", r"""
        import itertools


        def count_combos(xs, k, target):
            return sum(1 for combo in itertools.combinations(xs, k) if sum(combo) == target)
        """,
        [(([1, 2, 3, 4], 2, 5), 2), (([], 1, 0), 0), (([1, 1, 1], 2, 2), 3), (([5], 0, 0), 1), (([2, 4, 6], 3, 12), 1)],
        ("itertools.combinations", "itertools.permutations")),
    problem("dice_sums", r"""
        from itertools import product


        def dice_sums(n, sides):
            counts = {}
            for roll in product(range(1, sides + 1), repeat=n):
                s = sum(roll)
                counts[s] = counts.get(s, 0) + 1
            return counts
        """,
        [((1, 4), {1: 1, 2: 1, 3: 1, 4: 1}), ((2, 2), {2: 1, 3: 2, 4: 1}), ((0, 6), {0: 1}),
         ((2, 3), {2: 1, 3: 2, 4: 3, 5: 2, 6: 1})],
        ("range(1, sides + 1)", "range(1, sides)")),
    problem("interleave", r"""
        from itertools import chain, zip_longest

        _SKIP = object()


        def interleave(*lists):
            return [x for x in chain.from_iterable(zip_longest(*lists, fillvalue=_SKIP)) if x is not _SKIP]
        """,
        [(([1, 2, 3], ["a", "b"]), [1, "a", 2, "b", 3]), ((), []), (([], [1]), [1]), (([1], [2], [3, 4]), [1, 2, 3, 4]),
         (([0, 1], [2]), [0, 2, 1])],
        ("if x is not _SKIP", "if x")),
    problem("assign_round_robin", r"""
        from itertools import cycle


        def assign_round_robin(tasks, workers):
            plan = {w: [] for w in workers}
            for task, worker in zip(tasks, cycle(workers)):
                plan[worker].append(task)
            return plan
        """,
        [((["t1", "t2", "t3"], ["a", "b"]), {"a": ["t1", "t3"], "b": ["t2"]}), (([], ["a"]), {"a": []}),
         ((["x"], ["a", "b", "c"]), {"a": ["x"], "b": [], "c": []}), (([1, 2, 3, 4], ["p"]), {"p": [1, 2, 3, 4]})],
        ("zip(tasks, cycle(workers))", "zip(tasks, workers)")),
    problem("strip_leading_zeros", r"""
        from itertools import dropwhile


        def strip_leading_zeros(digits):
            rest = list(dropwhile(lambda d: d == 0, digits))
            return rest or [0]
        """,
        [(([0, 0, 1, 0],), [1, 0]), (([0, 0],), [0]), (([],), [0]), (([5],), [5]), (([1, 0, 0],), [1, 0, 0])],
        ("rest or [0]", "rest")),
    problem("total_by_key", r"""
        def read_records(lines):
            for line in lines:
                line = line.strip()
                if line and not line.startswith("#"):
                    yield line.split(",")


        def total_by_key(lines):
            totals = {}
            for key, value in read_records(lines):
                totals[key] = totals.get(key, 0) + int(value)
            return totals
        """,
        [((["a,1", "b,2", "a,3"],), {"a": 4, "b": 2}), (([],), {}), ((["# comment", "", "x,5"],), {"x": 5}),
         (([" c,10 ", "c,-10"],), {"c": 0})],
        ('if line and not line.startswith("#")', 'if not line.startswith("#")')),
    problem("running_average", r"""
        def averager():
            total = count = 0
            average = None
            while True:
                value = yield average
                total += value
                count += 1
                average = total / count


        def running_average(xs):
            gen = averager()
            next(gen)
            return [gen.send(x) for x in xs]
        """,
        [(([10, 20, 30],), [10.0, 15.0, 20.0]), (([],), []), (([1],), [1.0]), (([1, 2],), [1.0, 1.5]),
         (([-4, 4],), [-4.0, 0.0])],
        ("count += 1", "count = 1")),
    problem("unique_permutations", r"""
        from itertools import permutations


        def unique_permutations(s):
            return sorted({"".join(p) for p in permutations(s)})
        """,
        [((s,), sorted({"".join(p) for p in itertools.permutations(s)})) for s in ("ab", "", "aab", "a", "abcd")],
        ("permutations(s)}", "permutations(s, 2)}")),
    problem("partition", r"""
        from itertools import filterfalse, tee

        PREDICATES = {"even": lambda x: x % 2 == 0, "positive": lambda x: x > 0}


        def partition(xs, name):
            pred = PREDICATES[name]
            a, b = tee(xs)
            return [list(filter(pred, a)), list(filterfalse(pred, b))]
        """,
        [(([1, 2, 3, 4], "even"), [[2, 4], [1, 3]]), (([], "even"), [[], []]),
         (([-1, 0, 1], "positive"), [[1], [-1, 0]]),
         (([0], "even"), [[0], []])],
        ("x > 0", "x >= 0")),
    problem("power_table", r"""
        from itertools import product, starmap


        def power_table(bases, exps):
            return list(starmap(pow, product(bases, exps)))
        """,
        [(([2, 3], [0, 1, 2]), [1, 2, 4, 1, 3, 9]), (([], [1]), []), (([5], [3]), [125]), (([-1], [1, 2]), [-1, 1])],
        ("product(bases, exps)", "zip(bases, exps)")),
    problem("first_duplicate", r"""
        def first_duplicate(xs):
            seen = set()
            return next((x for x in xs if x in seen or seen.add(x)), None)
        """,
        [(([1, 2, 3, 2, 1],), 2), (([],), None), (([1, 2],), None), ((["a", "a"],), "a"), (([0, 0],), 0)],
        ("x in seen or seen.add(x)", "seen.add(x) or x in seen")),
    problem("take_every", r"""
        from itertools import islice


        def take_every(xs, step, limit):
            return list(islice((x * x for x in xs), 0, None, step))[:limit]
        """,
        [(([1, 2, 3, 4, 5], 2, 10), [1, 9, 25]), (([], 1, 3), []), (([3, 4], 1, 1), [9]),
         (([1, 2, 3, 4], 3, 5), [1, 16]),
         (([2], 5, 0), [])],
        ("islice((x * x for x in xs), 0, None, step)", "islice((x * x for x in xs), 1, None, step)")),
    problem("compress_flags", r"""
        from itertools import compress


        def compress_flags(items, flags):
            return list(compress(items, (f == "y" for f in flags)))
        """,
        [((["a", "b", "c"], "yny"), ["a", "c"]), (([], ""), []), (([1, 2], "nn"), []), (([1, 2, 3], "y"), [1]),
         (([4, 5], "Yy"), [5])],
        ('f == "y"', 'f.lower() == "y"')),
    problem("tokenize", r"""
        import re


        def iter_tokens(text):
            for m in re.finditer(r"\d+|[A-Za-z_]\w*|\S", text):
                tok = m.group()
                if tok.isdigit():
                    yield ("num", int(tok))
                elif tok[0].isalpha() or tok[0] == "_":
                    yield ("name", tok)
                else:
                    yield ("op", tok)


        def tokenize(text):
            return list(iter_tokens(text))
        """,
        [(("x = 42",), [("name", "x"), ("op", "="), ("num", 42)]), (("",), []),
         (("a+b1",), [("name", "a"), ("op", "+"), ("name", "b1")]), (("  7 ",), [("num", 7)]),
         (("_x*(2)",), [("name", "_x"), ("op", "*"), ("op", "("), ("num", 2), ("op", ")")])],
        (r"\d+|[A-Za-z_]\w*|\S", r"\d|[A-Za-z_]\w*|\S")),
    problem("bst_kth_smallest", r"""
        def inorder(node):
            if node is not None:
                value, left, right = node
                yield from inorder(left)
                yield value
                yield from inorder(right)


        def bst_kth_smallest(root, k):
            for i, value in enumerate(inorder(root), start=1):
                if i == k:
                    return value
            return None
        """,
        [((TREE, 1), 2), ((TREE, 4), 5), ((TREE, 6), 8), ((TREE, 7), None), ((None, 1), None)],
        ("start=1", "start=0")),
    problem("longest_collatz", r"""
        def collatz(n):
            while True:
                yield n
                if n == 1:
                    return
                n = n // 2 if n % 2 == 0 else 3 * n + 1


        def longest_collatz(limit):
            return max(range(1, limit + 1), key=lambda s: sum(1 for _ in collatz(s)))
        """,
        [((n,), oracles.longest_collatz(n)) for n in (1, 2, 3, 10, 20, 100)],
        ("range(1, limit + 1)", "range(1, limit)")),
]
