"""Problems built on `collections`: Counter, defaultdict, deque, OrderedDict, namedtuple and ChainMap."""

from __future__ import annotations

from . import oracles
from .problem import problem

PROBLEMS = [
    problem("most_common_char", r"""
        from collections import Counter


        def most_common_char(s):
            if not s:
                return ""
            counts = Counter(s)
            best = max(counts.values())
            return min(c for c in counts if counts[c] == best)
        """,
        [(("hello",), "l"), (("",), ""), (("abab",), "a"), (("zzya",), "z"), (("ba",), "a")],
        ("return min(", "return max(")),
    problem("group_anagrams", r"""
        from collections import defaultdict


        def group_anagrams(words):
            groups = defaultdict(list)
            for w in words:
                groups["".join(sorted(w))].append(w)
            return sorted(sorted(g) for g in groups.values())
        """,
        [((["eat", "tea", "tan", "ate", "nat", "bat"],), [["ate", "eat", "tea"], ["bat"], ["nat", "tan"]]),
         (([],), []), ((["a"],), [["a"]]), ((["ab", "ba", "abc"],), [["ab", "ba"], ["abc"]])],
        ('groups["".join(sorted(w))]', "groups[w]")),
    problem("sliding_max", r"""
        from collections import deque


        def sliding_max(nums, k):
            dq = deque()
            out = []
            for i, x in enumerate(nums):
                while dq and nums[dq[-1]] <= x:
                    dq.pop()
                dq.append(i)
                if dq[0] <= i - k:
                    dq.popleft()
                if i >= k - 1:
                    out.append(nums[dq[0]])
            return out
        """,
        [((xs, k), oracles.sliding_max(xs, k)) for xs, k in
         (([1, 3, -1, -3, 5, 3, 6, 7], 3), ([1], 1), ([], 2), ([9, 8, 7], 2), ([1, 2, 3], 3), ([5, 4, 3, 2, 1], 2))],
        ("dq[0] <= i - k", "dq[0] < i - k")),
    problem("honor_roll", r"""
        from collections import namedtuple

        Student = namedtuple("Student", "name grade")


        def honor_roll(rows, cutoff):
            students = [Student(*row) for row in rows]
            ranked = sorted(students, key=lambda s: (-s.grade, s.name))
            return [s.name for s in ranked if s.grade >= cutoff]
        """,
        [(([("a", 90), ("b", 80), ("c", 95)], 85), ["c", "a"]), (([], 50), []), (([("x", 70)], 70), ["x"]),
         (([("b", 90), ("a", 90)], 0), ["a", "b"])],
        ("s.grade >= cutoff", "s.grade > cutoff")),
    problem("first_unique_index", r"""
        from collections import Counter


        def first_unique_index(s):
            counts = Counter(s)
            for i, ch in enumerate(s):
                if counts[ch] == 1:
                    return i
            return -1
        """,
        [(("leetcode",), 0), (("loveleetcode",), 2), (("aabb",), -1), (("",), -1), (("abcabd",), 2)],
        ("return i\n", "return i + 1\n")),
    problem("resolve_settings", r"""
        from collections import ChainMap


        def resolve_settings(defaults, env, cli):
            merged = ChainMap(cli, env, defaults)
            return {key: merged[key] for key in sorted(merged)}
        """,
        [(({"a": 1, "b": 2}, {"b": 3}, {"c": 4}), {"a": 1, "b": 3, "c": 4}), (({}, {}, {}), {}),
         (({"x": 1}, {}, {"x": 9}), {"x": 9}), (({"k": 0}, {"k": 1}, {}), {"k": 1})],
        ("ChainMap(cli, env, defaults)", "ChainMap(defaults, env, cli)")),
    problem("josephus", r"""
        from collections import deque


        def josephus(n, k):
            people = deque(range(1, n + 1))
            order = []
            while people:
                people.rotate(-(k - 1))
                order.append(people.popleft())
            return order
        """,
        [((n, k), oracles.josephus(n, k)) for n, k in ((7, 3), (1, 1), (0, 2), (5, 1), (4, 2), (10, 4))],
        ("-(k - 1)", "-k")),
    problem("can_construct", r"""
        from collections import Counter


        def can_construct(note, magazine):
            return not (Counter(note) - Counter(magazine))
        """,
        [(("a", "b"), False), (("aa", "ab"), False), (("aa", "aab"), True), (("", ""), True), (("abc", "cba"), True)],
        ("Counter(note) - Counter(magazine)", "Counter(magazine) - Counter(note)")),
    problem("word_index", r"""
        import re
        from collections import defaultdict


        def word_index(lines):
            index = defaultdict(list)
            for number, line in enumerate(lines, start=1):
                for word in sorted(set(re.findall(r"\w+", line.lower()))):
                    index[word].append(number)
            return dict(index)
        """,
        [((["a b", "b c"],), {"a": [1], "b": [1, 2], "c": [2]}), (([],), {}), ((["Hi hi"],), {"hi": [1]}),
         ((["x", "", "x"],), {"x": [1, 3]})],
        ("start=1", "start=0")),
    problem("grid_shortest_path", r"""
        from collections import deque


        def grid_shortest_path(grid):
            rows, cols = len(grid), len(grid[0])
            if grid[0][0] == "#" or grid[-1][-1] == "#":
                return -1
            dist = {(0, 0): 0}
            queue = deque([(0, 0)])
            while queue:
                r, c = queue.popleft()
                if (r, c) == (rows - 1, cols - 1):
                    return dist[(r, c)]
                for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1)):
                    nr, nc = r + dr, c + dc
                    if 0 <= nr < rows and 0 <= nc < cols and grid[nr][nc] != "#" and (nr, nc) not in dist:
                        dist[(nr, nc)] = dist[(r, c)] + 1
                        queue.append((nr, nc))
            return -1
        """,
        [(([".."],), 1), ((["."],), 0), (([".#", "#."],), -1), ((["...", "##.", "..."],), 4), ((["#."],), -1),
         ((["..", ".."],), 2)],
        ("0 <= nr < rows", "0 <= nr <= rows")),
    problem("histogram", r"""
        from collections import Counter


        def histogram(values):
            counts = Counter(values)
            return [f"{v}: {'*' * counts[v]}" for v in sorted(counts)]
        """,
        [(([1, 2, 2, 3, 3, 3],), ["1: *", "2: **", "3: ***"]), (([],), []), ((["b", "a", "b"],), ["a: *", "b: **"]),
         (([0],), ["0: *"])],
        ("for v in sorted(counts)", "for v in counts")),
    problem("simplify_path", r"""
        def simplify_path(path):
            stack = []
            for part in path.split("/"):
                if part == "..":
                    if stack:
                        stack.pop()
                elif part and part != ".":
                    stack.append(part)
            return "/" + "/".join(stack)
        """,
        [(("/home/",), "/home"), (("/../",), "/"), (("/home//foo/",), "/home/foo"), (("/a/./b/../../c/",), "/c"),
         (("/",), "/"), (("/a/b/c/..",), "/a/b")],
        ("if stack:\n                stack.pop()", "stack.pop()")),
    problem("topo_sort", r"""
        from collections import defaultdict, deque


        def topo_sort(n, edges):
            graph = defaultdict(list)
            indegree = [0] * n
            for a, b in edges:
                graph[a].append(b)
                indegree[b] += 1
            queue = deque(i for i in range(n) if indegree[i] == 0)
            order = []
            while queue:
                node = queue.popleft()
                order.append(node)
                for nxt in graph[node]:
                    indegree[nxt] -= 1
                    if indegree[nxt] == 0:
                        queue.append(nxt)
            return order if len(order) == n else []
        """,
        [((4, [[0, 1], [0, 2], [1, 3], [2, 3]]), [0, 1, 2, 3]), ((2, [[0, 1], [1, 0]]), []), ((3, []), [0, 1, 2]),
         ((1, []), [0]), ((3, [[2, 1], [1, 0]]), [2, 1, 0]), ((3, [[0, 1], [1, 2], [2, 1]]), [])],
        ("return order if len(order) == n else []", "return order")),
    problem("can_form_palindrome", r"""
        from collections import Counter


        def can_form_palindrome(s):
            odd = sum(1 for n in Counter(s).values() if n % 2)
            return odd <= 1
        """,
        [(("civic",), True), (("ivicc",), True), (("hello",), False), (("",), True),
         (("aabbc",), True), (("ab",), False)],
        ("odd <= 1", "odd == 0")),
    problem("last_n_unique", r"""
        from collections import deque


        def last_n_unique(stream, n):
            recent = deque(maxlen=n)
            for x in stream:
                if x in recent:
                    recent.remove(x)
                recent.append(x)
            return list(recent)
        """,
        [(([1, 2, 3, 2, 4], 3), [3, 2, 4]), (([], 2), []), (([1, 1, 1], 2), [1]), (([5, 6], 5), [5, 6]),
         (([1, 2, 3, 1], 2), [3, 1])],
        ("recent.remove(x)", "pass")),
    problem("inventory_diff", r"""
        from collections import Counter


        def inventory_diff(before, after):
            b, a = Counter(before), Counter(after)
            return {"added": dict(sorted((a - b).items())), "removed": dict(sorted((b - a).items()))}
        """,
        [((["x", "y"], ["x", "y", "y"]), {"added": {"y": 1}, "removed": {}}), (([], []), {"added": {}, "removed": {}}),
         ((["a", "a"], []), {"added": {}, "removed": {"a": 2}}),
         ((["a", "b"], ["b", "c"]), {"added": {"c": 1}, "removed": {"a": 1}})],
        ('"removed": dict(sorted((b - a).items()))', '"removed": dict(sorted((a - b).items()))')),
]
