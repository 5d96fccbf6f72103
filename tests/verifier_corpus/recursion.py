"""Recursive problems: divide and conquer, backtracking, trees as nested tuples, memoised recurrences."""

from __future__ import annotations

import itertools
import math

from . import oracles
from .problem import problem

PROBLEMS = [
    problem("flatten", r"""
        def flatten(xs):
            out = []
            for x in xs:
                if isinstance(x, list):
                    out.extend(flatten(x))
                else:
                    out.append(x)
            return out
        """,
        [(([1, [2, [3, [4]]]],), [1, 2, 3, 4]), (([],), []), (([[], [[]]],), []), (([1, 2],), [1, 2]),
         (([[1, 2], 3, [4, [5, 6]]],), [1, 2, 3, 4, 5, 6])],
        ("out.extend(flatten(x))", "out.extend(x)")),
    problem("permutations", r"""
        def permutations(xs):
            if len(xs) <= 1:
                return [list(xs)]
            result = []
            for i, x in enumerate(xs):
                for rest in permutations(xs[:i] + xs[i + 1:]):
                    result.append([x] + rest)
            return result
        """,
        [((xs,), [list(p) for p in itertools.permutations(xs)]) for xs in ([1, 2, 3], [], [1], [1, 2], [4, 3, 2, 1])],
        ("len(xs) <= 1", "len(xs) == 1")),
    problem("subsets", r"""
        def subsets(xs):
            if not xs:
                return [[]]
            rest = subsets(xs[1:])
            return rest + [[xs[0]] + s for s in rest]
        """,
        [(([],), [[]]), (([1],), [[], [1]]), (([1, 2],), [[], [2], [1], [1, 2]]),
         (([1, 2, 3],), [[], [3], [2], [2, 3], [1], [1, 3], [1, 2], [1, 2, 3]])],
        ("return rest + [", "return [")),
    problem("hanoi", r"""
        def hanoi(n, src="A", dst="C", via="B"):
            if n == 0:
                return []
            return hanoi(n - 1, src, via, dst) + [(src, dst)] + hanoi(n - 1, via, dst, src)
        """,
        [((0,), []), ((1,), [("A", "C")]), ((2,), [("A", "B"), ("A", "C"), ("B", "C")]),
         ((3,), [("A", "C"), ("A", "B"), ("C", "B"), ("A", "C"), ("B", "A"), ("B", "C"), ("A", "C")])],
        ("hanoi(n - 1, via, dst, src)", "hanoi(n - 1, via, src, dst)")),
    problem("gcd_recursive", r"""
        def gcd_recursive(a, b):
            return a if b == 0 else gcd_recursive(b, a % b)
        """,
        [((a, b), math.gcd(a, b)) for a, b in ((12, 18), (0, 5), (7, 0), (17, 5), (0, 0), (270, 192))],
        ("b == 0", "a == 0")),
    problem("no_adjacent_ones", r"""
        def no_adjacent_ones(n):
            if n == 0:
                return [""]
            if n == 1:
                return ["0", "1"]
            return [s + "0" for s in no_adjacent_ones(n - 1)] + [s + "01" for s in no_adjacent_ones(n - 2)]
        """,
        [((0,), [""]), ((1,), ["0", "1"]), ((2,), ["00", "10", "01"]), ((3,), ["000", "100", "010", "001", "101"])],
        ('s + "01"', 's + "11"')),
    problem("grid_paths", r"""
        from functools import lru_cache

        def grid_paths(rows, cols):
            @lru_cache(maxsize=None)
            def walk(r, c):
                if r == 0 or c == 0:
                    return 1
                return walk(r - 1, c) + walk(r, c - 1)
            return walk(rows - 1, cols - 1)
        """,
        [((r, c), math.comb(r + c - 2, r - 1)) for r, c in ((1, 1), (2, 2), (3, 3), (3, 7), (10, 10))],
        ("walk(r - 1, c) + walk(r, c - 1)", "walk(r - 1, c) * walk(r, c - 1)")),
    problem("edit_distance", r"""
        from functools import lru_cache

        def edit_distance(a, b):
            @lru_cache(maxsize=None)
            def d(i, j):
                if i == 0:
                    return j
                if j == 0:
                    return i
                if a[i - 1] == b[j - 1]:
                    return d(i - 1, j - 1)
                return 1 + min(d(i - 1, j), d(i, j - 1), d(i - 1, j - 1))
            return d(len(a), len(b))
        """,
        [(("kitten", "sitting"), 3), (("", "abc"), 3), (("abc", ""), 3), (("same", "same"), 0), (("flaw", "lawn"), 2),
         (("intention", "execution"), 5)],
        ("return j", "return 0")),
    problem("bsearch", r"""
        def bsearch(xs, target, lo=0, hi=None):
            if hi is None:
                hi = len(xs)
            if lo >= hi:
                return -1
            mid = (lo + hi) // 2
            if xs[mid] == target:
                return mid
            if xs[mid] < target:
                return bsearch(xs, target, mid + 1, hi)
            return bsearch(xs, target, lo, mid)
        """,
        [(([1, 3, 5, 7, 9], 7), 3), (([1, 3, 5, 7, 9], 1), 0), (([], 4), -1), (([1, 3, 5], 4), -1), (([2], 2), 0),
         (([1, 3, 5, 7, 9], 9), 4)],
        ("xs[mid] < target", "xs[mid] > target")),
    problem("merge_sort", r"""
        def merge_sort(xs):
            if len(xs) <= 1:
                return list(xs)
            mid = len(xs) // 2
            left, right = merge_sort(xs[:mid]), merge_sort(xs[mid:])
            merged = []
            i = j = 0
            while i < len(left) and j < len(right):
                if left[i] <= right[j]:
                    merged.append(left[i])
                    i += 1
                else:
                    merged.append(right[j])
                    j += 1
            return merged + left[i:] + right[j:]
        """,
        [((xs,), sorted(xs)) for xs in ([5, 2, 4, 6, 1, 3], [], [1], [3, 3, 1], [-1, -5, 0], [2, 1])],
        ("merged + left[i:] + right[j:]", "merged + left[i:]")),
    problem("quicksort", r"""
        def quicksort(xs):
            if len(xs) <= 1:
                return xs
            pivot, *rest = xs
            smaller = quicksort([x for x in rest if x < pivot])
            larger = quicksort([x for x in rest if x >= pivot])
            return smaller + [pivot] + larger
        """,
        [((xs,), sorted(xs)) for xs in ([3, 1, 2], [], [2, 2, 1], [5, -1, 5, 0], [1])],
        ("x >= pivot", "x > pivot")),
    problem("dict_depth", r"""
        def dict_depth(tree):
            if not isinstance(tree, dict) or not tree:
                return 0
            return 1 + max(dict_depth(v) for v in tree.values())
        """,
        [(({},), 0), (({"a": 1},), 1), (({"a": {"b": {"c": 1}}},), 3), (({"a": {}, "b": {"c": {}}},), 2), ((5,), 0)],
        (" or not tree", "")),
    problem("count_change", r"""
        def count_change(amount, coins):
            if amount == 0:
                return 1
            if amount < 0 or not coins:
                return 0
            return count_change(amount - coins[0], coins) + count_change(amount, coins[1:])
        """,
        [((4, [1, 2]), 3), ((0, [1]), 1), ((3, []), 0), ((10, [2, 5, 3, 6]), 5), ((11, [5, 10]), 0)],
        ("amount < 0 or not coins", "amount < 0")),
    problem("is_palindrome_rec", r"""
        def is_palindrome_rec(s):
            if len(s) < 2:
                return True
            return s[0] == s[-1] and is_palindrome_rec(s[1:-1])
        """,
        [(("",), True), (("a",), True), (("abba",), True), (("abca",), False), (("racecar",), True), (("ab",), False)],
        ("s[1:-1]", "s[2:-1]")),
    problem("tree_sum", r"""
        def tree_sum(node):
            if node is None:
                return 0
            value, left, right = node
            return value + tree_sum(left) + tree_sum(right)
        """,
        [((None,), 0), (((1, None, None),), 1), (((1, (2, None, None), (3, (4, None, None), None)),), 10),
         (((-5, None, (5, None, None)),), 0), (((7, (1, None, None), None),), 8)],
        (" + tree_sum(right)", "")),
    problem("tree_height", r"""
        def tree_height(node):
            if node is None:
                return 0
            _, left, right = node
            return 1 + max(tree_height(left), tree_height(right))
        """,
        [((None,), 0), (((1, None, None),), 1), (((1, (2, None, None), (3, (4, None, None), None)),), 3),
         (((1, (2, (3, None, None), None), None),), 3)],
        ("max(", "min(")),
    problem("generate_parentheses", r"""
        def generate_parentheses(n):
            result = []

            def build(prefix, opened, closed):
                if len(prefix) == 2 * n:
                    result.append(prefix)
                    return
                if opened < n:
                    build(prefix + "(", opened + 1, closed)
                if closed < opened:
                    build(prefix + ")", opened, closed + 1)

            build("", 0, 0)
            return result
        """,
        [((0,), [""]), ((1,), ["()"]), ((2,), ["(())", "()()"]),
         ((3,), ["((()))", "(()())", "(())()", "()(())", "()()()"])],
        ("closed < opened", "closed <= opened")),
    problem("combination_sum", r"""
        def combination_sum(candidates, target):
            out = []

            def go(start, remaining, chosen):
                if remaining == 0:
                    out.append(list(chosen))
                    return
                for i in range(start, len(candidates)):
                    c = candidates[i]
                    if c <= remaining:
                        chosen.append(c)
                        go(i, remaining - c, chosen)
                        chosen.pop()

            go(0, target, [])
            return out
        """,
        [(([2, 3, 6, 7], 7), [[2, 2, 3], [7]]), (([2], 1), []), (([1], 2), [[1, 1]]),
         (([2, 3, 5], 8), [[2, 2, 2, 2], [2, 3, 3], [3, 5]])],
        ("go(i, remaining - c, chosen)", "go(i + 1, remaining - c, chosen)")),
    problem("n_queens", r"""
        def n_queens(n):
            def place(row, cols, diag1, diag2):
                if row == n:
                    return 1
                total = 0
                for c in range(n):
                    if c in cols or row - c in diag1 or row + c in diag2:
                        continue
                    total += place(row + 1, cols | {c}, diag1 | {row - c}, diag2 | {row + c})
                return total
            return place(0, frozenset(), frozenset(), frozenset())
        """,
        [((1,), 1), ((2,), 0), ((3,), 0), ((4,), 2), ((6,), 4), ((8,), 92)],
        (" or row + c in diag2", "")),
    problem("flood_fill", r"""
        def flood_fill(grid, r, c, new):
            grid = [row[:] for row in grid]
            old = grid[r][c]
            if old == new:
                return grid

            def fill(i, j):
                if 0 <= i < len(grid) and 0 <= j < len(grid[0]) and grid[i][j] == old:
                    grid[i][j] = new
                    fill(i + 1, j)
                    fill(i - 1, j)
                    fill(i, j + 1)
                    fill(i, j - 1)

            fill(r, c)
            return grid
        """,
        [(([[1, 1, 1], [1, 1, 0], [1, 0, 1]], 1, 1, 2), [[2, 2, 2], [2, 2, 0], [2, 0, 1]]),
         (([[0, 0], [0, 0]], 0, 0, 0), [[0, 0], [0, 0]]), (([[5]], 0, 0, 3), [[3]]),
         (([[1, 2], [2, 1]], 0, 0, 9), [[9, 2], [2, 1]])],
        ("0 <= i < len(grid)", "0 < i < len(grid)")),
    problem("fast_power", r"""
        def fast_power(base, exp):
            if exp == 0:
                return 1
            half = fast_power(base, exp // 2)
            return half * half * (base if exp % 2 else 1)
        """,
        [((b, e), b ** e) for b, e in ((2, 10), (3, 0), (5, 3), (-2, 5), (7, 13), (1, 1000))],
        ("exp % 2", "exp % 2 == 0")),
    problem("sum_digits_rec", r"""
        def sum_digits_rec(n):
            if n < 10:
                return n
            return n % 10 + sum_digits_rec(n // 10)
        """,
        [((0,), 0), ((7,), 7), ((10,), 1), ((12345,), 15), ((99,), 18)],
        ("n % 10 + ", "n % 9 + ")),
]
