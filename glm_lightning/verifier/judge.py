"""Turn the bytes a sandbox child wrote (plus the zygote's exit report) into a Verdict. Runs in the trusted parent.

The child's output is treated as hostile input: it must be a well-formed, complete, in-order record stream
(see child.py) ending with the job's nonce, or the verdict is "error". Expected values live only here; comparison is
exact in value *and* type, recursively (`True` is not `1`, `1.0` is not `1`, a tuple is not a list).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from . import protocol
from .verdict import Verdict

REPR_CHARS = 60
DETAIL_CHARS = 240
SIGXCPU_EXIT = -24  # waitstatus_to_exitcode of a child killed by SIGXCPU (RLIMIT_CPU)
RESOURCE_EXCEPTIONS = frozenset({"MemoryError"})


@dataclass(frozen=True)
class Reply:
    """What came back for one job: the zygote's header and the child's raw bytes, or an infrastructure error."""

    header: dict[str, Any] | None
    payload: bytes
    error: str | None = None
    sent_at: float = 0.0
    done_at: float = 0.0


class MalformedStream(ValueError):
    pass


def strict_equal(got: Any, expected: Any) -> bool:
    """Equality with identical types at every level (NaN equals NaN; dict keys must match type too)."""
    if type(got) is not type(expected):
        return False
    if type(got) is float:
        return got == expected or (math.isnan(got) and math.isnan(expected))
    if type(got) in (list, tuple):
        return len(got) == len(expected) and all(strict_equal(a, b) for a, b in zip(got, expected))
    if type(got) is dict:
        if len(got) != len(expected):
            return False
        got_by_key = {protocol.dumps(k): v for k, v in got.items()}
        for key, value in expected.items():
            tag = protocol.dumps(key)
            if tag not in got_by_key or not strict_equal(got_by_key[tag], value):
                return False
        return True
    if isinstance(got, protocol.Unsupported):
        return False
    return got == expected


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= REPR_CHARS else text[: REPR_CHARS - 3] + "..."


def _tagged_str(tagged: Any) -> str:
    value = protocol.decode(tagged)
    if type(value) is not str:
        raise MalformedStream("expected a string")
    return value


@dataclass
class _Stream:
    """Parsed record stream."""

    started: bool = False
    invalid: str | None = None
    crash: str | None = None
    violation: str | None = None
    results: list[tuple[str, Any]] | None = None  # ("v", value) or ("x", exception name), in test order
    ended: bool = False


def parse_stream(payload: bytes, nonce: str, total: int) -> _Stream:
    """Strictly parse the child's records; raises MalformedStream on anything unexpected."""
    stream = _Stream(results=[])
    assert stream.results is not None
    if payload and not payload.endswith(b"\n"):
        raise MalformedStream("incomplete last record")
    for raw in payload.split(b"\n")[:-1] if payload else []:
        if stream.ended:
            raise MalformedStream("data after the end record")
        try:
            record = json.loads(raw)
        except (ValueError, RecursionError):
            raise MalformedStream("not JSON") from None
        if type(record) is not list or not record or type(record[0]) is not str:
            raise MalformedStream("not a record")
        kind, n = record[0], len(record)
        if not stream.started:
            if kind != "t" or n != 2:
                raise MalformedStream("missing start record")
            stream.started = True
        elif kind in ("v", "x") and n == 3 and stream.invalid is None and stream.crash is None \
                and stream.violation is None:
            if type(record[1]) is not int or record[1] != len(stream.results) or record[1] >= total:
                raise MalformedStream("test results out of order")
            if kind == "v":
                stream.results.append(("v", protocol.decode_result(record[2])))
            else:
                stream.results.append(("x", _tagged_str(record[2])))
        elif kind == "invalid" and n == 2 and not stream.results and stream.invalid is None and stream.crash is None:
            stream.invalid = _tagged_str(record[1])
        elif kind == "crash" and n == 2 and not stream.results and stream.invalid is None and stream.crash is None:
            stream.crash = _tagged_str(record[1])
        elif kind == "viol" and n == 2 and stream.violation is None:
            stream.violation = _tagged_str(record[1])
        elif kind == "end" and n == 4:
            if record[1] != nonce:
                raise MalformedStream("wrong nonce in end record")
            if type(record[2]) is not int or record[2] != len(stream.results):
                raise MalformedStream("end record count mismatch")
            stream.ended = True
        else:
            raise MalformedStream(f"unexpected record {kind!r}")
    return stream


def judge(reply: Reply, nonce: str, entry_point: str, tests: list[tuple[tuple, Any]], timeout_s: float) -> Verdict:
    """Classify one reply. Exit status alone never counts as success."""
    total = len(tests)
    elapsed = max(0.0, reply.done_at - reply.sent_at)

    def verdict(status: str, passed: int, detail: str) -> Verdict:
        return Verdict(status, passed, total, detail[:DETAIL_CHARS], elapsed)  # type: ignore[arg-type]

    if reply.error is not None or reply.header is None:
        return verdict("error", 0, f"sandbox failure: {reply.error or 'no reply'}")
    header = reply.header
    if header.get("truncated"):
        return verdict("error", 0, "result too large (output cap exceeded)")
    try:
        stream = parse_stream(reply.payload, nonce, total)
    except (MalformedStream, protocol.DecodeError) as exc:
        if header.get("timed_out"):
            return verdict("timeout", 0, f"timed out after {timeout_s:g} s")
        return verdict("error", 0, f"malformed result stream ({exc})")

    results = stream.results or []
    passes = [kind == "v" and strict_equal(value, expected)
              for (kind, value), (_, expected) in zip(results, tests)]
    passed = sum(passes)
    exit_code = header.get("exit")
    if header.get("timed_out") or (not stream.ended and exit_code == SIGXCPU_EXIT):
        why = "timed out" if header.get("timed_out") else "CPU time limit exceeded"
        return verdict("timeout", passed, f"{why} after {timeout_s:g} s ({len(results)} of {total} tests ran)")
    if not stream.ended:
        how = f"killed by signal {-exit_code}" if isinstance(exit_code, int) and exit_code < 0 else \
            f"exit code {exit_code}"
        return verdict("error", passed, f"sandbox exited without a complete result ({how})")
    if stream.violation is not None:
        return verdict("error", passed, f"forbidden operation: {stream.violation}")
    if stream.invalid is not None:
        return verdict("invalid", 0, stream.invalid)
    if stream.crash is not None:
        return verdict("error", 0, f"crashed while loading the module: {stream.crash}")
    if len(results) != total:
        return verdict("error", passed, f"only {len(results)} of {total} tests ran")
    for kind, value in results:
        if kind == "x" and value in RESOURCE_EXCEPTIONS:
            return verdict("error", passed, f"resource limit exceeded ({value})")
    if passed == total:
        return verdict("passed", passed, f"all {total} tests passed")
    index = passes.index(False)
    (kind, value), (args, expected) = results[index], tests[index]
    call = f"{entry_point}{_short(args) if len(args) != 1 else '(' + _short(args[0]) + ')'}"
    if kind == "x":
        first = f"{call} raised {value}"
    elif isinstance(value, protocol.Unsupported):
        first = f"{call} returned an unsupported value ({value.reason}), expected {_short(expected)}"
    else:
        first = f"{call} returned {_short(value)}, expected {_short(expected)}"
    return verdict("failed", passed, f"{passed}/{total} passed; first failure: {first}")
