"""Issue 46, category 8: the caller's Verifier is safe under fork, threads and close(), through the public API.

- A DDP-style fork (Lightning's ddp_fork, torch.multiprocessing with fork): the child inherits the parent's
  Verifier. Using it raises ForeignProcessError (the pipes are the parent's: frames would interleave); the child's
  own Verifier works; the child's exit (finalizer, atexit) leaves the parent's servers and scratch directory alone.
  The control re-enables the old behaviour inside the child (the child believes it owns the pool) and shows the
  parent's servers are then killed, so the test can fail.
- A Ray-style worker: a multiprocessing fork pool whose workers find a global Verifier inherited from the parent.
- close() from another thread while a batch runs: the batch stops with VerifierClosedError, and no server is left
  or restarted afterwards; concurrent check_many calls from several threads are serialised and all correct.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from glm_lightning.verifier import ForeignProcessError, Verifier, VerifierClosedError

REPO = Path(__file__).resolve().parents[1]
T = [((1,), 2), ((5,), 6)]
GOOD = "def f(x):\n    return x + 1\n"
SLOW = "import time\ndef f(x):\n    time.sleep(0.25)\n    return x + 1\n"

FORK_SCRIPT = r"""
import gc, json, os, sys
from glm_lightning.verifier import ForeignProcessError, Verifier
T = [((1,), 2)]
GOOD = "def f(x):\n    return x + 1\n"
mode, report = sys.argv[1], sys.argv[2]
v = Verifier(timeout_s=3.0, workers=2)
assert v.check(GOOD, "f", T).passed
servers = [z.proc.pid for z in v._pool.zygotes]
r, w = os.pipe()
if mode == "bypass":  # control: the at-fork hook does not see this pool
    from glm_lightning.verifier import pool as pool_module
    pool_module._LIVE_POOLS.discard(v._pool)
pid = os.fork()
if pid == 0:  # the DDP-style child: normal interpreter exit at the end (atexit and finalizers run)
    os.close(r)
    if mode == "bypass":  # control: the child believes it owns the pool (what every fork did before issue 46)
        v._pool.owner_pid = os.getpid()
    assert v.owner_pid != os.getpid() or mode == "bypass"
    try:
        v.check(GOOD, "f", T)
        used = "used"
    except ForeignProcessError as exc:
        used = "refused: " + str(exc)[:60]
    with Verifier(timeout_s=3.0, workers=1) as mine:
        own = mine.check(GOOD, "f", T).passed
    os.write(w, json.dumps({"used": used, "own": own}).encode())
    os.close(w)
    del v
    gc.collect()
    sys.exit(0)
os.close(w)
child = json.loads(os.read(r, 4096))
os.waitpid(pid, 0)
alive = [os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z" for p in servers]
after = [z.proc.pid if z.proc is not None else None for z in v._pool.zygotes]
scratch = os.path.isdir(v._pool.scratch)
try:
    verdict = v.check(GOOD, "f", T).passed
except Exception as exc:
    verdict = repr(exc)
json.dump({"child": child, "alive": alive, "same": after == servers, "scratch": scratch, "verdict": verdict},
          open(report, "w"))
v.close()
"""


def _run_fork_script(mode: str, tmp_path: Path) -> dict:
    report = tmp_path / f"{mode}.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", FORK_SCRIPT, mode, str(report)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(report.read_text())


def test_ddp_style_fork_child_never_touches_the_parents_servers(tmp_path):
    out = _run_fork_script("protected", tmp_path)
    assert out["child"]["used"].startswith("refused: this Verifier belongs to process"), out
    assert out["child"]["own"] is True
    assert out["alive"] == [True, True] and out["same"] and out["scratch"] and out["verdict"], out


def test_ddp_style_fork_control_without_the_fork_guard_kills_the_parents_servers(tmp_path):
    """Control: with the guard bypassed in the child, its exit stops the parent's servers and deletes the scratch
    directory (the bug of issue 46), so the test above can fail."""
    out = _run_fork_script("bypass", tmp_path)
    assert out["child"]["used"] == "used"
    assert out["alive"] != [True, True] and not out["scratch"], out


# --------------------------------------------------------------------------------------------------------------
# Ray-style workers: forked pool workers find the parent's Verifier in a global
# --------------------------------------------------------------------------------------------------------------
_INHERITED: Verifier | None = None
_OWN: list[Verifier] = []


def _worker_task(x: int) -> tuple[str, bool]:
    assert _INHERITED is not None
    try:
        _INHERITED.check(GOOD, "f", T)
        inherited = "used"
    except ForeignProcessError:
        inherited = "refused"
    if not _OWN:  # a worker creates its own Verifier once, as a Ray actor would
        _OWN.append(Verifier(timeout_s=3.0, workers=1))
    verdict = _OWN[0].check(GOOD, "f", [((x,), x + 1)])
    return inherited, verdict.passed


def _worker_exit() -> None:
    for v in _OWN:
        v.close()


def test_ray_style_forked_workers_use_their_own_verifier():
    global _INHERITED
    with Verifier(timeout_s=3.0, workers=2) as v:
        servers = [z.proc.pid for z in v._pool.zygotes]
        _INHERITED = v
        try:
            ctx = multiprocessing.get_context("fork")
            with ctx.Pool(2) as pool:
                results = pool.map(_worker_task, range(6))
                pool.map(_worker_exit_many, range(2))
        finally:
            _INHERITED = None
        assert results == [("refused", True)] * 6
        assert [z.proc.pid for z in v._pool.zygotes] == servers
        assert all(z.proc.poll() is None for z in v._pool.zygotes)
        assert v.check(GOOD, "f", T).passed


def _worker_exit_many(_: int) -> None:
    _worker_exit()


def test_a_verifier_cannot_be_pickled_into_a_worker():
    with Verifier(timeout_s=3.0, workers=1) as v:
        with pytest.raises(TypeError, match="create one in each worker"):
            pickle.dumps(v)


# --------------------------------------------------------------------------------------------------------------
# Threads and close()
# --------------------------------------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_close_from_another_thread_cancels_the_batch_and_leaves_no_server():
    v = Verifier(timeout_s=3.0, workers=2)
    servers = [z.proc.pid for z in v._pool.zygotes]
    outcome: list = []

    def batch() -> None:
        try:
            outcome.append(v.check_many([(SLOW, "f", T)] * 24))
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion below
            outcome.append(exc)

    thread = threading.Thread(target=batch)
    thread.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until the batch holds the pool (a condition, not a fixed sleep)
        if not v._pool._lock.acquire(blocking=False):
            break
        v._pool._lock.release()
    else:
        pytest.fail("the batch never started")
    v.close()
    thread.join(30)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], VerifierClosedError), outcome
    assert not any(_alive(pid) for pid in servers)
    assert all(z.proc is None for z in v._pool.zygotes), "a server was restarted after close()"
    assert not os.path.exists(v._pool.scratch)
    with pytest.raises(VerifierClosedError):
        v.check(GOOD, "f", T)
    v.close()  # idempotent


def test_concurrent_batches_from_threads_are_serialised_and_correct():
    with Verifier(timeout_s=3.0, workers=2) as v:
        results: dict[int, list[bool]] = {}

        def batch(k: int) -> None:
            items = [(GOOD if (i + k) % 2 else "def f(x):\n    return x\n", "f", T) for i in range(12)]
            results[k] = [x.passed for x in v.check_many(items)]

        threads = [threading.Thread(target=batch, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert {k: r for k, r in results.items()} == {k: [bool((i + k) % 2) for i in range(12)] for k in range(3)}
