"""Graph search and dynamic programming: shortest paths, union-find, spanning trees, classic DP tables."""

from __future__ import annotations

from . import oracles
from .problem import problem

PROBLEMS = [
    problem("dijkstra", r"""
        import heapq


        def dijkstra(n, edges, source):
            graph = [[] for _ in range(n)]
            for a, b, w in edges:
                graph[a].append((b, w))
            dist = [None] * n
            heap = [(0, source)]
            while heap:
                d, node = heapq.heappop(heap)
                if dist[node] is not None:
                    continue
                dist[node] = d
                for nxt, w in graph[node]:
                    if dist[nxt] is None:
                        heapq.heappush(heap, (d + w, nxt))
            return dist
        """,
        [((3, [[0, 1, 4], [0, 2, 1], [2, 1, 2]], 0), [0, 3, 1]), ((1, [], 0), [0]), ((3, [[0, 1, 1]], 0), [0, 1, None]),
         ((4, [[0, 1, 1], [1, 2, 1], [0, 2, 5], [2, 3, 1]], 0), [0, 1, 2, 3]), ((2, [[1, 0, 7]], 1), [7, 0])],
        ("(d + w, nxt)", "(w, nxt)")),
    problem("count_components", r"""
        def count_components(n, edges):
            parent = list(range(n))

            def find(x):
                while parent[x] != x:
                    parent[x] = parent[parent[x]]
                    x = parent[x]
                return x

            components = n
            for a, b in edges:
                ra, rb = find(a), find(b)
                if ra != rb:
                    parent[ra] = rb
                    components -= 1
            return components
        """,
        [((5, [[0, 1], [1, 2], [3, 4]]), 2), ((3, []), 3), ((0, []), 0), ((4, [[0, 1], [1, 0], [2, 3], [3, 2]]), 2),
         ((4, [[0, 1], [2, 3], [1, 2]]), 1)],
        ("if ra != rb:", "if a != b:")),
    problem("is_bipartite", r"""
        from collections import deque


        def is_bipartite(graph):
            color = {}
            for start in range(len(graph)):
                if start in color:
                    continue
                color[start] = 0
                queue = deque([start])
                while queue:
                    node = queue.popleft()
                    for nxt in graph[node]:
                        if nxt not in color:
                            color[nxt] = 1 - color[node]
                            queue.append(nxt)
                        elif color[nxt] == color[node]:
                            return False
            return True
        """,
        [(([[1, 3], [0, 2], [1, 3], [0, 2]],), True), (([[1, 2, 3], [0, 2], [0, 1, 3], [0, 2]],), False), (([],), True),
         (([[]],), True), (([[1], [0], [3], [2]],), True), (([[1, 2], [0, 2], [0, 1]],), False)],
        ("1 - color[node]", "color[node]")),
    problem("has_cycle", r"""
        def has_cycle(n, edges):
            graph = {i: [] for i in range(n)}
            for a, b in edges:
                graph[a].append(b)
            state = [0] * n

            def visit(node):
                if state[node] == 1:
                    return True
                if state[node] == 2:
                    return False
                state[node] = 1
                if any(visit(nxt) for nxt in graph[node]):
                    return True
                state[node] = 2
                return False

            return any(visit(i) for i in range(n))
        """,
        [((2, [[0, 1], [1, 0]]), True), ((3, [[0, 1], [1, 2]]), False), ((1, [[0, 0]]), True), ((0, []), False),
         ((4, [[0, 1], [0, 2], [1, 3], [2, 3]]), False)],
        ("if state[node] == 1:", "if state[node]:")),
    problem("mst_weight", r"""
        def mst_weight(n, edges):
            parent = list(range(n))

            def find(x):
                while parent[x] != x:
                    x = parent[x]
                return x

            total = used = 0
            for w, a, b in sorted((w, a, b) for a, b, w in edges):
                ra, rb = find(a), find(b)
                if ra != rb:
                    parent[ra] = rb
                    total += w
                    used += 1
            return total if used == n - 1 else -1
        """,
        [((4, [[0, 1, 1], [1, 2, 2], [2, 3, 3], [0, 3, 4], [0, 2, 5]]), 6), ((1, []), 0), ((3, [[0, 1, 1]]), -1),
         ((3, [[0, 1, 5], [1, 2, 5], [0, 2, 1]]), 6), ((2, [[0, 1, -3]]), -3)],
        ("sorted((w, a, b) for a, b, w in edges)", "((w, a, b) for a, b, w in edges)")),
    problem("count_islands", r"""
        def count_islands(grid):
            seen = set()
            islands = 0
            for r, row in enumerate(grid):
                for c, cell in enumerate(row):
                    if cell == "1" and (r, c) not in seen:
                        islands += 1
                        stack = [(r, c)]
                        seen.add((r, c))
                        while stack:
                            i, j = stack.pop()
                            for ni, nj in ((i + 1, j), (i - 1, j), (i, j + 1), (i, j - 1)):
                                if 0 <= ni < len(grid) and 0 <= nj < len(grid[ni]) and grid[ni][nj] == "1" \
                                        and (ni, nj) not in seen:
                                    seen.add((ni, nj))
                                    stack.append((ni, nj))
            return islands
        """,
        [((["11000", "11000", "00100", "00011"],), 3), (([],), 0), ((["0"],), 0), ((["111", "010", "111"],), 1),
         ((["101", "010", "101"],), 5), ((["001", "101", "111"],), 1)],
        ("(i - 1, j), ", "")),
    problem("ladder_length", r"""
        import string
        from collections import deque


        def ladder_length(begin, end, words):
            words = set(words)
            if end not in words:
                return 0
            queue = deque([(begin, 1)])
            seen = {begin}
            while queue:
                word, steps = queue.popleft()
                if word == end:
                    return steps
                for i in range(len(word)):
                    for ch in string.ascii_lowercase:
                        candidate = word[:i] + ch + word[i + 1:]
                        if candidate in words and candidate not in seen:
                            seen.add(candidate)
                            queue.append((candidate, steps + 1))
            return 0
        """,
        [(("hit", "cog", ["hot", "dot", "dog", "lot", "log", "cog"]), 5),
         (("hit", "cog", ["hot", "dot", "dog", "lot", "log"]), 0), (("a", "c", ["a", "b", "c"]), 2),
         (("same", "same", ["same"]), 1), (("ab", "cd", ["ad", "cd"]), 3)],
        ("word[i + 1:]", "word[i:]")),
    problem("min_meeting_rooms", r"""
        import heapq


        def min_meeting_rooms(intervals):
            ends = []
            for start, end in sorted(intervals):
                if ends and ends[0] <= start:
                    heapq.heapreplace(ends, end)
                else:
                    heapq.heappush(ends, end)
            return len(ends)
        """,
        [(([[0, 30], [5, 10], [15, 20]],), 2), (([[7, 10], [2, 4]],), 1), (([],), 0), (([[1, 5], [5, 10]],), 1),
         (([[1, 5], [2, 6], [3, 7]],), 3)],
        ("ends[0] <= start", "ends[0] < start")),
    problem("min_merge_cost", r"""
        import heapq


        def min_merge_cost(sizes):
            heap = list(sizes)
            heapq.heapify(heap)
            cost = 0
            while len(heap) > 1:
                a = heapq.heappop(heap)
                b = heapq.heappop(heap)
                cost += a + b
                heapq.heappush(heap, a + b)
            return cost
        """,
        [(([4, 3, 2, 6],), 29), (([],), 0), (([5],), 0), (([1, 1],), 2), (([1, 2, 3, 4, 5],), 33),
         (([9, 1, 8, 2],), 34)],
        ("heapq.heapify(heap)", "heap.sort(reverse=True)")),
    problem("knapsack", r"""
        def knapsack(capacity, items):
            best = [0] * (capacity + 1)
            for weight, value in items:
                for c in range(capacity, weight - 1, -1):
                    best[c] = max(best[c], best[c - weight] + value)
            return best[capacity]
        """,
        [((4, [[1, 1], [3, 4], [4, 5]]), 5), ((0, [[1, 5]]), 0), ((10, []), 0),
         ((5, [[2, 3], [3, 4], [4, 5], [5, 6]]), 7),
         ((3, [[1, 2], [1, 2], [1, 2]]), 6), ((4, [[2, 3]]), 3)],
        ("range(capacity, weight - 1, -1)", "range(weight, capacity + 1)")),
    problem("lcs_length", r"""
        def lcs_length(a, b):
            prev = [0] * (len(b) + 1)
            for ch in a:
                cur = [0]
                for j, other in enumerate(b):
                    cur.append(prev[j] + 1 if ch == other else max(prev[j + 1], cur[j]))
                prev = cur
            return prev[-1]
        """,
        [(("abcde", "ace"), 3), (("abc", "def"), 0), (("", "x"), 0), (("abc", "abc"), 3), (("AGGTAB", "GXTXAYB"), 4)],
        ("max(prev[j + 1], cur[j])", "prev[j + 1]")),
    problem("min_coins", r"""
        def min_coins(coins, amount):
            INF = float("inf")
            best = [0] + [INF] * amount
            for a in range(1, amount + 1):
                for c in coins:
                    if c <= a and best[a - c] + 1 < best[a]:
                        best[a] = best[a - c] + 1
            return best[amount] if best[amount] != INF else -1
        """,
        [(([1, 2, 5], 11), 3), (([2], 3), -1), (([1], 0), 0), (([3, 7], 14), 2), (([2, 5, 10, 1], 27), 4)],
        ("c <= a", "c < a")),
    problem("longest_palindrome", r"""
        def longest_palindrome(s):
            best = ""
            for center in range(2 * len(s) - 1):
                lo, hi = center // 2, (center + 1) // 2
                while lo >= 0 and hi < len(s) and s[lo] == s[hi]:
                    lo -= 1
                    hi += 1
                if hi - lo - 1 > len(best):
                    best = s[lo + 1:hi]
            return best
        """,
        [(("babad",), "bab"), (("cbbd",), "bb"), (("",), ""), (("a",), "a"), (("forgeeksskeegfor",), "geeksskeeg")],
        ("lo >= 0", "lo > 0")),
    problem("trap_water", r"""
        def trap_water(heights):
            left, right = 0, len(heights) - 1
            left_max = right_max = water = 0
            while left < right:
                if heights[left] < heights[right]:
                    left_max = max(left_max, heights[left])
                    water += left_max - heights[left]
                    left += 1
                else:
                    right_max = max(right_max, heights[right])
                    water += right_max - heights[right]
                    right -= 1
            return water
        """,
        [((h,), oracles.trapped_water(h)) for h in
         ([0, 1, 0, 2, 1, 0, 1, 3, 2, 1, 2, 1], [4, 2, 0, 3, 2, 5], [], [1], [3, 0, 3], [5, 4, 1, 2])],
        ("left_max = max(left_max, heights[left])", "left_max = heights[left]")),
    # The entry point is a plain function on purpose: the verifier accepts only a real function object as the entry
    # point, so a top-level @lru_cache entry point would be reported "invalid" (the cached helper is fine).
    problem("unique_bst_count", r"""
        from functools import lru_cache


        @lru_cache(maxsize=None)
        def catalan(n):
            if n <= 1:
                return 1
            return sum(catalan(root - 1) * catalan(n - root) for root in range(1, n + 1))


        def unique_bst_count(n):
            return catalan(n)
        """,
        [((0,), 1), ((1,), 1), ((3,), 5), ((5,), 42), ((10,), 16796)],
        ("range(1, n + 1)", "range(1, n)")),
]
