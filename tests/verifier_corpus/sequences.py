"""List and array problems: searching, windows, intervals and ordering (with `bisect` and `heapq`)."""

from __future__ import annotations

from . import oracles
from .problem import problem

PROBLEMS = [
    problem("two_sum", r"""
        def two_sum(nums, target):
            seen = {}
            for i, x in enumerate(nums):
                if target - x in seen:
                    return [seen[target - x], i]
                seen[x] = i
            return []
        """,
        [(([2, 7, 11, 15], 9), [0, 1]), (([3, 2, 4], 6), [1, 2]), (([3, 3], 6), [0, 1]), (([1, 2], 7), []),
         (([], 0), [])],
        ("[seen[target - x], i]", "[i, seen[target - x]]")),
    problem("binary_search", r"""
        from bisect import bisect_left

        def binary_search(xs, target):
            i = bisect_left(xs, target)
            if i < len(xs) and xs[i] == target:
                return i
            return -1
        """,
        [(([1, 3, 5, 7], 5), 2), (([1, 3, 5, 7], 4), -1), (([], 1), -1), (([1, 3, 5, 7], 8), -1), (([2, 2, 2], 2), 0)],
        ("i < len(xs) and ", "")),
    problem("count_in_range", r"""
        from bisect import bisect_left, bisect_right

        def count_in_range(xs, lo, hi):
            return bisect_right(xs, hi) - bisect_left(xs, lo)
        """,
        [(([1, 2, 2, 3, 5], 2, 3), 3), (([], 0, 10), 0), (([1, 2, 3], 4, 9), 0), (([1, 1, 1], 1, 1), 3),
         (([1, 5, 9], 0, 100), 3)],
        ("bisect_right(xs, hi)", "bisect_left(xs, hi)")),
    problem("grade", r"""
        import bisect

        def grade(score):
            return "FDCBA"[bisect.bisect([60, 70, 80, 90], score)]
        """,
        [((59,), "F"), ((60,), "D"), ((75,), "C"), ((89,), "B"), ((90,), "A"), ((100,), "A"), ((0,), "F")],
        ("bisect.bisect(", "bisect.bisect_left(")),
    problem("closest_value", r"""
        import bisect

        def closest_value(sorted_xs, target):
            i = bisect.bisect_left(sorted_xs, target)
            candidates = sorted_xs[max(0, i - 1):i + 1]
            return min(candidates, key=lambda x: (abs(x - target), x))
        """,
        [(([1, 3, 8, 10], 7), 8), (([1, 3, 8, 10], 5), 3), (([1, 2], 0), 1), (([5], 100), 5), (([1, 3], 2), 1)],
        ("max(0, i - 1)", "max(0, i)")),
    problem("lis_length", r"""
        import bisect

        def lis_length(nums):
            tails = []
            for x in nums:
                i = bisect.bisect_left(tails, x)
                if i == len(tails):
                    tails.append(x)
                else:
                    tails[i] = x
            return len(tails)
        """,
        [((xs,), oracles.lis_length(xs)) for xs in
         ([10, 9, 2, 5, 3, 7, 101, 18], [], [7, 7, 7], [0, 1, 0, 3, 2, 3], [1, 2, 3, 4], [5, 4, 3])],
        ("bisect.bisect_left", "bisect.bisect_right")),
    problem("kth_largest", r"""
        import heapq

        def kth_largest(nums, k):
            heap = []
            for x in nums:
                heapq.heappush(heap, x)
                if len(heap) > k:
                    heapq.heappop(heap)
            return heap[0]
        """,
        [(([3, 2, 1, 5, 6, 4], 2), 5), (([1], 1), 1), (([3, 2, 3, 1, 2, 4, 5, 5, 6], 4), 4), (([7, 7, 7], 2), 7),
         (([-1, -2, -3], 3), -3)],
        ("len(heap) > k", "len(heap) >= k")),
    problem("merge_sorted", r"""
        import heapq

        def merge_sorted(lists):
            heap = [(lst[0], i, 0) for i, lst in enumerate(lists) if lst]
            heapq.heapify(heap)
            out = []
            while heap:
                value, i, j = heapq.heappop(heap)
                out.append(value)
                if j + 1 < len(lists[i]):
                    heapq.heappush(heap, (lists[i][j + 1], i, j + 1))
            return out
        """,
        [((ls,), sorted(sum(ls, []))) for ls in
         ([[1, 4, 5], [1, 3, 4], [2, 6]], [], [[], [1]], [[5], [1, 2, 3]], [[-1, 0, 0, 9], [0]])],
        ("j + 1 < len(lists[i])", "j + 1 < len(lists[i]) - 1")),
    problem("running_median", r"""
        import heapq

        def running_median(xs):
            low, high = [], []
            out = []
            for x in xs:
                heapq.heappush(low, -x)
                heapq.heappush(high, -heapq.heappop(low))
                if len(high) > len(low):
                    heapq.heappush(low, -heapq.heappop(high))
                if len(low) > len(high):
                    out.append(float(-low[0]))
                else:
                    out.append((-low[0] + high[0]) / 2)
            return out
        """,
        [((xs,), oracles.prefix_medians(xs)) for xs in ([2, 1, 5, 7, 2, 0, 5], [], [5], [1, 2], [3, 3, 3])],
        ("len(high) > len(low)", "len(high) > len(low) + 1")),
    problem("top_k_frequent", r"""
        import heapq
        from collections import Counter

        def top_k_frequent(words, k):
            counts = Counter(words)
            return heapq.nsmallest(k, counts, key=lambda w: (-counts[w], w))
        """,
        [((["a", "b", "a", "c", "b", "a"], 2), ["a", "b"]), (([], 3), []), ((["x", "y"], 1), ["x"]),
         ((["b", "a", "b", "a"], 2), ["a", "b"]), ((["i", "love", "i", "code"], 3), ["i", "code", "love"])],
        ("(-counts[w], w)", "(counts[w], w)")),
    problem("rotate", r"""
        def rotate(xs, k):
            if not xs:
                return []
            k %= len(xs)
            return xs[-k:] + xs[:-k]
        """,
        [(([1, 2, 3, 4, 5], 2), [4, 5, 1, 2, 3]), (([], 3), []), (([1, 2, 3], 0), [1, 2, 3]),
         (([1, 2, 3], 4), [3, 1, 2]), (([1], 100), [1])],
        ("k %= len(xs)", "k = min(k, len(xs))")),
    problem("chunk", r"""
        def chunk(xs, size):
            return [xs[i:i + size] for i in range(0, len(xs), size)]
        """,
        [(([1, 2, 3, 4, 5], 2), [[1, 2], [3, 4], [5]]), (([], 3), []), (([1, 2, 3], 3), [[1, 2, 3]]),
         (([1, 2], 5), [[1, 2]]), (("abcd", 2), ["ab", "cd"])],
        ("range(0, len(xs), size)", "range(0, len(xs) - 1, size)")),
    problem("dedupe", r"""
        def dedupe(xs):
            seen = set()
            out = []
            for x in xs:
                if x not in seen:
                    seen.add(x)
                    out.append(x)
            return out
        """,
        [(([1, 2, 1, 3, 2],), [1, 2, 3]), (([],), []), ((["a", "a"],), ["a"]), (([3, 2, 1],), [3, 2, 1]),
         (([0, False, 1],), [0, 1])],
        ("return out", "return sorted(out)")),
    problem("max_subarray", r"""
        def max_subarray(nums):
            best = current = nums[0]
            for x in nums[1:]:
                current = max(x, current + x)
                best = max(best, current)
            return best
        """,
        [((xs,), oracles.max_subarray(xs)) for xs in
         ([-2, 1, -3, 4, -1, 2, 1, -5, 4], [1], [-3, -1, -2], [5, 4, -1, 7, 8], [0, 0])],
        ("best = current = nums[0]", "best = current = 0")),
    problem("product_except_self", r"""
        def product_except_self(nums):
            n = len(nums)
            out = [1] * n
            prefix = 1
            for i in range(n):
                out[i] = prefix
                prefix *= nums[i]
            suffix = 1
            for i in range(n - 1, -1, -1):
                out[i] *= suffix
                suffix *= nums[i]
            return out
        """,
        [((xs,), oracles.product_except_self(xs)) for xs in
         ([1, 2, 3, 4], [2, 3], [0, 1, 2], [5], [-1, 1, 0, -3, 3])],
        ("range(n - 1, -1, -1)", "range(n - 1, 0, -1)")),
    problem("moving_average", r"""
        def moving_average(xs, k):
            if len(xs) < k:
                return []
            window = sum(xs[:k])
            out = [window / k]
            for i in range(k, len(xs)):
                window += xs[i] - xs[i - k]
                out.append(window / k)
            return out
        """,
        [(([1, 2, 3, 4, 5], 2), [1.5, 2.5, 3.5, 4.5]), (([1, 2], 3), []), (([4, 4, 4], 3), [4.0]),
         (([1, 2, 3], 1), [1.0, 2.0, 3.0]), (([0, 10, 0, 10], 2), [5.0, 5.0, 5.0])],
        ("xs[i] - xs[i - k]", "xs[i] - xs[i - k + 1]")),
    problem("spiral_order", r"""
        def spiral_order(matrix):
            out = []
            while matrix:
                out.extend(matrix[0])
                matrix = [list(row) for row in zip(*matrix[1:])][::-1]
            return out
        """,
        [(([[1, 2, 3], [4, 5, 6], [7, 8, 9]],), [1, 2, 3, 6, 9, 8, 7, 4, 5]), (([],), []), (([[1]],), [1]),
         (([[1, 2], [3, 4]],), [1, 2, 4, 3]),
         (([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]],), [1, 2, 3, 4, 8, 12, 11, 10, 9, 5, 6, 7])],
        ("][::-1]", "]")),
    problem("matmul", r"""
        def matmul(a, b):
            return [[sum(x * y for x, y in zip(row, col)) for col in zip(*b)] for row in a]
        """,
        [((a, b), oracles.matmul(a, b)) for a, b in
         (([[1, 2], [3, 4]], [[5, 6], [7, 8]]), ([[1]], [[2]]), ([[1, 2, 3]], [[1], [2], [3]]),
          ([[1], [2]], [[3, 4]]), ([[2, 0], [0, 2]], [[1, -1], [4, 5]]))],
        ("for col in zip(*b)", "for col in b")),
    problem("merge_intervals", r"""
        def merge_intervals(intervals):
            merged = []
            for start, end in sorted(intervals):
                if merged and start <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], end)
                else:
                    merged.append([start, end])
            return merged
        """,
        [(([[1, 3], [2, 6], [8, 10], [15, 18]],), [[1, 6], [8, 10], [15, 18]]), (([],), []),
         (([[1, 4], [4, 5]],), [[1, 5]]), (([[1, 4], [2, 3]],), [[1, 4]]), (([[5, 6], [1, 2]],), [[1, 2], [5, 6]])],
        ("start <= merged[-1][1]", "start < merged[-1][1]")),
    problem("second_largest", r"""
        def second_largest(xs):
            first = second = None
            for x in xs:
                if first is None or x > first:
                    first, second = x, first
                elif x != first and (second is None or x > second):
                    second = x
            return second
        """,
        [(([1, 2, 3],), 2), (([5, 5, 5],), None), (([],), None), (([3, 1, 3, 2],), 2), (([-1, -2],), -2),
         (([2, 10, 7],), 7)],
        ("x != first and ", "")),
    problem("pivot_index", r"""
        def pivot_index(nums):
            total = sum(nums)
            left = 0
            for i, x in enumerate(nums):
                if left == total - left - x:
                    return i
                left += x
            return -1
        """,
        [(([1, 7, 3, 6, 5, 6],), 3), (([1, 2, 3],), -1), (([2, 1, -1],), 0), (([],), -1), (([0],), 0)],
        ("total - left - x", "total - left")),
    problem("missing_number", r"""
        def missing_number(nums):
            n = len(nums)
            return n * (n + 1) // 2 - sum(nums)
        """,
        [(([3, 0, 1],), 2), (([0],), 1), (([1],), 0), (([9, 6, 4, 2, 3, 5, 7, 0, 1],), 8), (([],), 0)],
        ("n = len(nums)", "n = max(nums)")),
    problem("max_profit", r"""
        def max_profit(prices):
            best, low = 0, float("inf")
            for p in prices:
                low = min(low, p)
                best = max(best, p - low)
            return best
        """,
        [(([7, 1, 5, 3, 6, 4],), 5), (([7, 6, 4, 3, 1],), 0), (([],), 0), (([1, 2],), 1), (([2, 4, 1],), 2)],
        ("p - low", "low - p")),
    problem("append_item", r"""
        def append_item(item, items=None):
            if items is None:
                items = []
            items.append(item)
            return items
        """,
        [(("a",), ["a"]), (("b",), ["b"]), (("c", ["x"]), ["x", "c"]), ((1,), [1])],
        ("items=None", "items=[]")),
    problem("zigzag_merge", r"""
        def zigzag_merge(a, b):
            out = []
            for i in range(max(len(a), len(b))):
                if i < len(a):
                    out.append(a[i])
                if i < len(b):
                    out.append(b[i])
            return out
        """,
        [(([1, 3], [2, 4]), [1, 2, 3, 4]), (([], []), []), (([1, 2, 3], [9]), [1, 9, 2, 3]), (([], [5, 6]), [5, 6]),
         ((["a"], ["b", "c"]), ["a", "b", "c"])],
        ("max(len(a), len(b))", "min(len(a), len(b))")),
]
