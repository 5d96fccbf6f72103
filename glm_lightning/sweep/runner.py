"""Running every (variant, seed) of a study as an isolated `python -m glm_lightning fit ...` subprocess.

- Each run has its own directory `<out>/<study>/<variant>/seed<k>/` holding its TensorBoard events, `config.yaml`,
  `stdout.log` / `stderr.log`, `RUN.json` (the run's fingerprint: `sweep.fingerprint`), and on success `DONE.json`
  (final value of every scalar tag, wall time, the exact command, the fingerprint and its parts).
- Rerunning a sweep skips runs with a matching `DONE.json`, resumes an unfinished run of the same fingerprint from
  its `checkpoints/last.ckpt`, and starts the others over. A finished run of other arguments is never deleted: its
  directory is renamed `seed<k>.old-<n>`. A finished run of the same arguments made from other inputs (a config
  text, a checkpoint or the package source changed: `stale_runs`) makes the sweep refuse, naming what changed,
  unless it is told to accept the old runs or to run them again.
- Stopping the driver (Ctrl-C, SIGTERM) sends SIGTERM to the running runs, which save `last.ckpt` at the end of their
  current step and exit (SIGKILL after a grace period); the runs share the driver's process group, so killing that
  group stops them too.
- A failing run writes `FAILED.json` (return code, stderr tail); the other runs continue.
- Backends: `local` (a thread pool of `workers` subprocesses, `OMP_NUM_THREADS=threads` each) and `ray` (one Ray task
  per run; the task returns the run directory's files so a cluster without a shared filesystem works too).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from glm_lightning.sweep.events import final_values, read_scalars
from glm_lightning.sweep.fingerprint import combine, describe_changes, file_digest, git_revision, resolve_file
from glm_lightning.sweep.study import REPO_ROOT, Study, StudyError

DONE_FILE = "DONE.json"
FAILED_FILE = "FAILED.json"
RUN_FILE = "RUN.json"
STOP_GRACE_S = 60.0
STDERR_TAIL_LINES = 25
MAX_RETURNED_FILE_BYTES = 64 * 2 ** 20


@dataclass
class RunSpec:
    variant: str
    seed: int
    run_dir: Path
    args: list[str]
    fingerprint: str
    base: str = ""
    base_text: str = ""
    parts: dict[str, Any] = field(default_factory=dict)
    identity: str = ""

    @property
    def key(self) -> str:
        return f"{self.variant}/seed{self.seed}"

    def command(self, python: str | None = None) -> list[str]:
        return [python or sys.executable, "-m", "glm_lightning", "fit", *self.args]


@dataclass
class RunResult:
    spec: RunSpec
    status: str  # "done" (ran now), "skipped" (finished earlier), "failed", "cancelled"
    final: dict[str, float] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    returncode: int | None = None
    error: str = ""
    git: str = ""
    """The commit checked out when the run finished (its DONE.json); empty for runs recorded before runs kept it."""
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """`{tag: [(step, value), ...]}` of the study's metrics when known without the run's folder (a saved results file)."""

    @property
    def ok(self) -> bool:
        return self.status in ("done", "skipped")


def log_dir_args(run_dir: Path) -> list[str]:
    """Arguments that put a run's logs (events, config.yaml, checkpoints) directly into `run_dir`."""
    return [f"--trainer.logger.init_args.save_dir={run_dir}", "--trainer.logger.init_args.name=",
            "--trainer.logger.init_args.version=", f"--trainer.default_root_dir={run_dir}",
            "--trainer.enable_progress_bar=false"]


def plan_runs(study: Study, out: Path) -> list[RunSpec]:
    """All runs of the study, seed-major (both arms of a seed finish close together)."""
    base_text = study.base.read_text()
    specs = []
    for seed in study.seeds:
        for variant in study.variants:
            run_dir = (out / study.name / variant.name / f"seed{seed}").resolve()
            parts = study.fingerprint_parts(variant, seed)
            specs.append(RunSpec(variant.name, seed, run_dir, study.run_args(variant, seed) + log_dir_args(run_dir),
                                 combine(parts), str(study.base), base_text, parts, study.identity(variant, seed)))
    return specs


def _done_file(spec: RunSpec) -> dict[str, Any] | None:
    try:
        done = json.loads((spec.run_dir / DONE_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return done if isinstance(done, dict) else None


def changes_since(spec: RunSpec, done: dict[str, Any]) -> list[str] | None:
    """How the finished run `done` differs from the planned `spec`: [] when it is the same run from the same
    inputs; what changed (config texts, checkpoints, source) when it is the same run (same arguments) made from
    other inputs; None when it is another run (other arguments, or, for a run recorded before fingerprints had
    parts, another base config)."""
    loaded = changed_weights(done)
    if done.get("fingerprint") == spec.fingerprint:
        return loaded
    parts = done.get("parts")
    if isinstance(parts, dict):
        if parts.get("arguments") != spec.parts.get("arguments"):
            return None
        return describe_changes(parts, spec.parts) + loaded or ["the fingerprint"]
    if spec.identity and done.get("fingerprint") == spec.identity:
        return ["checkpoints and package source unknown (the run predates fingerprints that cover them)"]
    return None


def loaded_weights(run_dir: Path) -> dict[str, str]:
    """The weights files a finished run loaded, with their digests, as its module recorded them in hparams.yaml
    (`loaded_weights`): whatever named them, an argument, a config file or a code default."""
    import yaml

    out: dict[str, str] = {}
    for path in sorted(run_dir.rglob("hparams.yaml"), key=lambda p: p.stat().st_mtime):
        try:
            hp = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(hp, dict) and isinstance(hp.get("loaded_weights"), dict):
            out.update({str(k): str(v) for k, v in hp["loaded_weights"].items()})
    return out


def changed_weights(done: dict[str, Any]) -> list[str]:
    """The weights a finished run loaded (DONE.json's `loaded_weights`) that are gone or differ now: the
    fingerprint names only checkpoints its arguments and config files name, this covers every one the run read."""
    out = []
    for name, digest in sorted((done.get("loaded_weights") or {}).items()):
        path = resolve_file(name, ())
        now = file_digest(path)[:16] if path is not None else "missing"
        if now != digest:
            out.append(f"weights it loaded from {name} ({digest} then, {now} now)")
    return out


def read_done(spec: RunSpec, accept_old: bool = False) -> dict[str, Any] | None:
    """The run's DONE.json if it exists and was written for the same run from the same inputs; with `accept_old`
    also one of the same arguments made from other inputs (config texts, checkpoints, source)."""
    done = _done_file(spec)
    if done is None:
        return None
    changed = changes_since(spec, done)
    if changed == [] or (accept_old and changed is not None):
        return done
    return None


def stale_runs(specs: Sequence[RunSpec]) -> list[tuple[RunSpec, list[str]]]:
    """Finished runs of the same arguments made from other inputs, with what changed."""
    out = []
    for spec in specs:
        done = _done_file(spec)
        changed = changes_since(spec, done) if done is not None else None
        if changed:
            out.append((spec, changed))
    return out


def stale_message(stale: Sequence[tuple[RunSpec, list[str]]], out_dir: Path) -> str:
    """One line: how many finished runs are stale, what changed, and the two ways on."""
    what = list(dict.fromkeys(c for _, changed in stale for c in changed))
    return (f"{len(stale)} finished run(s) in {out_dir} were made from other inputs than this sweep's "
            f"(changed: {'; '.join(what)}); pass --accept-old-runs to use them as they are, or --rerun-changed to "
            f"run them again (the old runs are kept as seed<k>.old-<n>)")


def run_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env["JSONARGPARSE_DEPRECATION_WARNINGS"] = "off"
    return env


def tail(path: Path, lines: int = STDERR_TAIL_LINES) -> str:
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _aside(run_dir: Path) -> Path:
    n = 1
    while run_dir.with_name(f"{run_dir.name}.old-{n}").exists():
        n += 1
    return run_dir.with_name(f"{run_dir.name}.old-{n}")


def prepare_run_dir(spec: RunSpec, log: Callable[[str], None] = print) -> list[str]:
    """Make the run directory ready; returns the extra arguments that resume an unfinished run of the same settings
    (`--ckpt_path <run>/checkpoints/last.ckpt`), else []. Never deletes a finished run."""
    run_dir = spec.run_dir
    if run_dir.exists():
        last = run_dir / "checkpoints" / "last.ckpt"
        try:
            same = json.loads((run_dir / RUN_FILE).read_text()).get("fingerprint") == spec.fingerprint
        except (OSError, json.JSONDecodeError):
            same = False
        if (run_dir / DONE_FILE).is_file():  # finished with other settings: keep it, out of the way
            aside = _aside(run_dir)
            run_dir.rename(aside)
            log(f"[sweep] {spec.key}: a finished run of other settings was moved to {aside}")
        elif same and last.is_file():
            (run_dir / FAILED_FILE).unlink(missing_ok=True)
            return ["--ckpt_path", str(last)]
        else:
            shutil.rmtree(run_dir)  # unfinished and not resumable: nothing of value
    run_dir.mkdir(parents=True)
    (run_dir / RUN_FILE).write_text(json.dumps({"fingerprint": spec.fingerprint, "parts": spec.parts}) + "\n")
    return []


def launch(spec: RunSpec, env: dict[str, str], timeout_s: float | None = None,
           register: Callable[[subprocess.Popen | None], None] | None = None,
           python: str | None = None) -> tuple[int, float]:
    """Run one training subprocess (resuming an unfinished one); returns (return code, wall seconds)."""
    command = spec.command(python) + prepare_run_dir(spec)
    t0 = time.perf_counter()
    with open(spec.run_dir / "stdout.log", "ab") as out, open(spec.run_dir / "stderr.log", "ab") as err:
        with open(spec.run_dir / "command.txt", "a") as fh:
            fh.write(" ".join(command) + "\n")
        proc = subprocess.Popen(command, stdout=out, stderr=err, env=env)  # the driver's process group
        if register:
            register(proc)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            with open(spec.run_dir / "stderr.log", "a") as fh:
                fh.write(f"\n[sweep] killed after the run timeout of {timeout_s:g} s\n")
            rc = -9
        finally:
            if register:
                register(None)
    return rc, time.perf_counter() - t0


def stop_processes(procs: Iterable[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM (each run saves last.ckpt at the end of its step and exits), then SIGKILL after `grace_s`."""
    procs = [p for p in procs if p.poll() is None]
    for proc in procs:
        proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def finalize(spec: RunSpec, rc: int, wall_s: float) -> RunResult:
    """Turn a finished subprocess into a RunResult; writes DONE.json or FAILED.json."""
    if rc == 0:
        try:
            final, steps = final_values(read_scalars(spec.run_dir))
        except Exception as err:  # noqa: BLE001 - unreadable events make the run a failure, not the sweep
            error = f"could not read TensorBoard events: {err}"
        else:
            error = "" if final else "the run finished but wrote no TensorBoard scalars (is trainer.logger set?)"
        if not error:
            git = git_revision()
            done = {"variant": spec.variant, "git": git, "seed": spec.seed, "fingerprint": spec.fingerprint,
                    "parts": spec.parts, "identity": spec.identity, "final": final, "steps": steps,
                    "wall_s": round(wall_s, 2), "loaded_weights": loaded_weights(spec.run_dir),
                    "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "command": " ".join(spec.command())}
            (spec.run_dir / DONE_FILE).write_text(json.dumps(done, indent=1, sort_keys=True) + "\n")
            return RunResult(spec, "done", final, steps, wall_s, rc, git=git)
    else:
        error = tail(spec.run_dir / "stderr.log") or f"exit status {rc}"
    (spec.run_dir / FAILED_FILE).write_text(json.dumps({"returncode": rc, "wall_s": round(wall_s, 2),
                                                         "error": error}, indent=1) + "\n")
    return RunResult(spec, "failed", wall_s=wall_s, returncode=rc, error=error)


# --- backends --------------------------------------------------------------------------------------------------------
Outcome = tuple[RunSpec, int, float]


class LocalBackend:
    """A pool of `workers` threads, each running one subprocess at a time."""

    def __init__(self, workers: int, threads: int = 1, timeout_s: float | None = None) -> None:
        self.workers, self.timeout_s, self.env = max(1, workers), timeout_s, run_env(threads)
        self._abort = threading.Event()
        self._procs: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    def _one(self, spec: RunSpec) -> Outcome | None:
        if self._abort.is_set():
            return None
        holder: list[subprocess.Popen] = []

        def register(proc: subprocess.Popen | None) -> None:
            with self._lock:
                if proc is not None:
                    holder.append(proc)
                    self._procs.add(proc)
                    if self._abort.is_set():  # started while the sweep was being stopped
                        proc.terminate()
                else:
                    self._procs.difference_update(holder)
        rc, wall = launch(spec, self.env, self.timeout_s, register)
        return spec, rc, wall

    def _kill_all(self) -> None:
        with self._lock:
            procs = list(self._procs)
        stop_processes(procs)

    def run(self, specs: Sequence[RunSpec], on_outcome: Callable[[Outcome], None]) -> None:
        self._abort.clear()
        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="sweep")
        futures = [pool.submit(self._one, s) for s in specs]
        try:
            for fut in as_completed(futures):
                outcome = fut.result()
                if outcome is not None:
                    on_outcome(outcome)
        except BaseException:
            self._abort.set()
            for fut in futures:
                fut.cancel()
            self._kill_all()
            raise
        finally:
            pool.shutdown(wait=True)


def _collect_files(run_dir: Path) -> dict[str, bytes]:
    files = {}
    for path in run_dir.rglob("*"):
        if path.is_file() and path.suffix != ".ckpt" and path.stat().st_size <= MAX_RETURNED_FILE_BYTES:
            files[str(path.relative_to(run_dir))] = path.read_bytes()
    return files


def ray_task(spec: RunSpec, threads: int, timeout_s: float | None) -> tuple[int, float, dict[str, bytes]]:
    """Body of one Ray task: run on whichever node Ray picked; return the run directory's files (no checkpoints) so
    the driver gets events and logs even without a shared filesystem."""
    import tempfile

    try:
        spec.run_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # the driver's path cannot exist on this node: run in a temporary directory
        local = Path(tempfile.mkdtemp(prefix="glm-sweep-")) / spec.run_dir.name
        spec.args = [a.replace(str(spec.run_dir), str(local)) for a in spec.args]
        spec.run_dir = local
    if not Path(spec.base).is_file():  # another node: use the driver's base config text
        local_base = spec.run_dir.parent / f".base-{spec.variant}-seed{spec.seed}.yaml"
        local_base.write_text(spec.base_text)
        spec.args = [str(local_base) if a == spec.base else a for a in spec.args]
    rc, wall = launch(spec, run_env(threads), timeout_s)
    return rc, wall, _collect_files(spec.run_dir)


def import_ray() -> Any:
    """The ray module, or a one-line StudyError saying how to install it (a dry run checks this too, so it never
    says "config OK" for a backend that cannot start)."""
    try:
        import ray
    except ImportError as err:
        raise StudyError("the ray backend needs Ray: pip install -e '.[ray]' (or pip install 'ray>=2.40')") from err
    return ray


class RayBackend:
    """One Ray task per run. Connects to `address` (or $RAY_ADDRESS) when given, else starts a local Ray with
    `workers` CPUs. At most `workers` runs are in flight."""

    def __init__(self, workers: int, threads: int = 1, timeout_s: float | None = None,
                 address: str | None = None) -> None:
        self.ray = import_ray()
        ray = self.ray
        self.workers, self.threads, self.timeout_s = max(1, workers), threads, timeout_s
        address = address or os.environ.get("RAY_ADDRESS") or None
        self.owns_ray = not ray.is_initialized()  # started (or connected) here, so shut down here after the runs
        if self.owns_ray:
            kwargs: dict[str, Any] = {"address": address, "log_to_driver": False}
            if address is None:
                kwargs["num_cpus"] = self.workers * threads
            try:
                ray.init(**kwargs)
            except Exception as err:  # noqa: BLE001 - ConnectionError, ray's AuthenticationError, ...
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise StudyError(f"cannot connect to the Ray cluster at {address}: {first[:300]} (a cluster started "
                                 f"by `ray start --head` uses token authentication: set RAY_AUTH_MODE=token on the "
                                 f"driver, with the token in ~/.ray/auth_token or $RAY_AUTH_TOKEN)") from None

    def run(self, specs: Sequence[RunSpec], on_outcome: Callable[[Outcome], None]) -> None:
        ray = self.ray
        remote = ray.remote(num_cpus=self.threads, max_retries=0)(ray_task)
        queue = list(specs)
        inflight: dict[Any, RunSpec] = {}
        try:
            while queue or inflight:
                while queue and len(inflight) < self.workers:
                    spec = queue.pop(0)
                    inflight[remote.remote(spec, self.threads, self.timeout_s)] = spec
                ready, _ = ray.wait(list(inflight), num_returns=1)
                spec = inflight.pop(ready[0])
                try:
                    rc, wall, files = ray.get(ready[0])
                except Exception as err:  # noqa: BLE001 - a task that died is a failed run
                    spec.run_dir.mkdir(parents=True, exist_ok=True)
                    (spec.run_dir / "stderr.log").write_text(f"[sweep] ray task failed: {err}\n")
                    on_outcome((spec, -1, 0.0))
                    continue
                for rel, data in files.items():
                    dest = spec.run_dir / rel
                    if not dest.is_file() or dest.stat().st_size != len(data):
                        dest.parent.mkdir(parents=True, exist_ok=True)
                        dest.write_bytes(data)
                on_outcome((spec, rc, wall))
        except BaseException:
            for ref in inflight:
                ray.cancel(ref, force=True)
            raise
        finally:
            if self.owns_ray:  # a local Ray's processes would otherwise outlive the sweep in the calling process
                ray.shutdown()


def check_metrics(study: Study, result: RunResult) -> None:
    """Every study metric must be a scalar tag of a finished run; otherwise the study file is wrong."""
    missing = [m.tag for m in study.metrics if m.tag not in result.final]
    if missing:
        raise StudyError(f"{study.path}: metric(s) {missing} were not logged by run {result.spec.key} "
                         f"({result.spec.run_dir}); its scalar tags are {sorted(result.final)}. "
                         f"Fix `metrics` in the study file.")


def finished_result(spec: RunSpec, done: dict[str, Any]) -> RunResult:
    """A RunResult of a run finished earlier; an accepted old run keeps the fingerprint it was made with."""
    if done.get("fingerprint") != spec.fingerprint:
        spec = replace(spec, fingerprint=str(done.get("fingerprint")), parts=dict(done.get("parts") or {}))
    return RunResult(spec, "skipped", done.get("final", {}), done.get("steps", {}), float(done.get("wall_s", 0.0)),
                     git=str(done.get("git") or ""))


def execute(study: Study, specs: Iterable[RunSpec], backend: LocalBackend | RayBackend,
            log: Callable[[str], None] = print, accept_old: bool = False) -> list[RunResult]:
    """Skip finished runs (with `accept_old` also those of the same arguments made from other inputs), launch the
    rest on `backend`, check the metric tags after the first finished run."""
    specs = list(specs)
    results: dict[str, RunResult] = {}
    todo = []
    for spec in specs:
        done = read_done(spec, accept_old)
        if done is not None:
            results[spec.key] = finished_result(spec, done)
        else:
            todo.append(spec)
    checked = False
    for res in results.values():
        check_metrics(study, res)
        checked = True
        break
    log(f"[sweep] {study.name}: {len(specs)} runs, {len(specs) - len(todo)} already done, {len(todo)} to run")
    counter = [len(specs) - len(todo)]

    def on_outcome(outcome: Outcome) -> None:
        nonlocal checked
        spec, rc, wall = outcome
        res = finalize(spec, rc, wall)
        results[spec.key] = res
        counter[0] += 1
        if res.ok:
            primary = study.primary.tag
            shown = f"{primary}={res.final[primary]:.4f}" if primary in res.final else "(primary metric missing)"
            log(f"[sweep] [{counter[0]}/{len(specs)}] {spec.key} finished in {wall:.0f} s: {shown}")
            if not checked:
                check_metrics(study, res)
                checked = True
        else:
            log(f"[sweep] [{counter[0]}/{len(specs)}] {spec.key} FAILED (exit {rc}) after {wall:.0f} s; "
                f"see {spec.run_dir / 'stderr.log'}:\n    " + res.error.strip().replace("\n", "\n    ")[-2000:])

    if todo:
        backend.run(todo, on_outcome)
    return [results.get(s.key, RunResult(s, "cancelled")) for s in specs]
