"""Study files: loading, validation and the command line of every (variant, seed) run.

A study YAML (see `docs/sweeps.md`):

    name: ordering                                # optional; default: the file name
    description: blocked vs interleaved ...       # optional, shown in REPORT.md
    base: configs/experiments/base_composition.yaml   # a stage config (relative to the repo root or this file)
    overrides: {trainer.max_steps: 60}            # CLI-style keys common to all runs
    variable: data.init_args.ordering             # the dotted config key the study changes ...
    values: [blocked, interleaved]                # ... and its values (variant name = the value), or instead:
    variants: {repeated: {data.init_args.diversity: 8}, diverse: {data.init_args.diversity: 88}}
    control: blocked                              # the variant every other one is compared with
    seeds: 10                                     # a count (0..N-1) or an explicit list
    seed_keys: [seed_everything, data.init_args.seed]   # optional: the keys that receive the seed
    metrics:                                      # TensorBoard scalar tags; the first is the primary one
      - {tag: val/completion_acc, higher_is_better: true, scale: 100, unit: points}
      - val/loss                                  # strings: lower is better for */loss, */bpb, */ppl
    budget: ...                                   # free text (why this size), shown in the report
    tutorial: ...                                 # free markdown: the numbers to compare with
    expected_minutes: 28                          # optional: wall minutes of the whole study with --workers 2
    claims: [...]                                 # optional: the tutorial's claims it tests (`sweep.claims`)
    regime: ...                                   # optional: the regime its rows were measured in (findings table)
    blocks:                                       # optional, instead of `seeds`: groups of seeds sharing overrides,
      pt0: {seeds: [0, 1, 2], overrides: {model.init_args.init_weights: runs/starts/pt0.ckpt}}   # e.g. a start
      pt1: {seeds: [10, 11, 12], overrides: {model.init_args.init_weights: runs/starts/pt1.ckpt}} # checkpoint each

With `blocks`, every seed belongs to one block and its runs get the block's overrides; arms are paired within a seed,
so within a block (the comparison's pairs never cross blocks), and the report adds a per-block section.

Validation happens at load time (`load_study`) for the file itself, and in `validate_config` by parsing the base
config plus every variant's overrides with the project's LightningCLI parser and instantiating the model, data and
logger/callback classes (without training), so a misspelt key or a bad value fails before any run starts and the
error names the variant and the key.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from glm_lightning.sweep.claims import Claim, parse_claims
from glm_lightning.sweep.fingerprint import (REPO_ROOT, combine, environment, fingerprint_parts, input_digests,
                                             portable_path)
from glm_lightning.sweep.equivalence import Equivalence, parse_equivalences
from glm_lightning.sweep.score_at import ScoreAt, completions_at, parse_score_at

DEFAULT_SEED_KEYS = ("seed_everything", "data.init_args.seed")
LOWER_IS_BETTER_SUFFIXES = ("loss", "bpb", "ppl", "perplexity")
KNOWN_KEYS = {
    "name", "description", "base", "overrides", "variable", "values", "variants", "control", "seeds", "seed_keys",
    "metrics", "higher_is_better", "budget", "tutorial", "claims", "expected_minutes", "regime", "blocks", "score_at",
    "equivalences", "inputs", "power_plan", "cpu",
}
_NAME_RE = re.compile(r"^[A-Za-z0-9_.+-]+$")
_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class StudyError(ValueError):
    """A study file or its runs are unusable; the message says what to fix."""


@dataclass(frozen=True)
class Metric:
    tag: str
    higher_is_better: bool = True
    scale: float = 1.0
    unit: str = ""
    bounds: tuple[float, float] | None = None
    """The range the metric can take (e.g. [0, 1] for rates): intervals are clipped to it; None = unbounded."""

    @property
    def label(self) -> str:
        return f"{self.tag} ({'higher' if self.higher_is_better else 'lower'} is better)"


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: dict[str, Any]


@dataclass(frozen=True)
class Block:
    """Seeds that share overrides (e.g. one start checkpoint): the unit arms are paired within."""

    name: str
    seeds: tuple[int, ...]
    overrides: dict[str, Any]


@dataclass
class Study:
    name: str
    path: Path
    base: Path
    overrides: dict[str, Any]
    variable: str | None
    variants: list[Variant]
    control: str
    seeds: list[int]
    metrics: list[Metric]
    seed_keys: tuple[str, ...] = DEFAULT_SEED_KEYS
    description: str = ""
    budget: str = ""
    tutorial: str = ""
    seeds_from_count: bool = True
    raw: dict[str, Any] = field(default_factory=dict)
    claims: list[Claim] = field(default_factory=list)
    expected_minutes: float | None = None
    regime: str = ""
    blocks: dict[str, Block] = field(default_factory=dict)
    score_at: ScoreAt | None = None
    """Which evaluation of each run is scored (`sweep.score_at`); None = the last logged value."""
    equivalences: list[Equivalence] = field(default_factory=list)
    """Checked equivalences of earlier config texts with the shipped one (`sweep.equivalence`)."""
    inputs: tuple[str, ...] = ()
    cpu: str = ""
    """For runs made before runs recorded their CPU: the CPU the study's report states (shown as stated, not
    recorded)."""
    power_note: str = ""
    """What the power plan said before this invocation ran (`sweep.plan`), shown in the report's Setup."""
    """Files (repository paths) the study's settings come from outside any config, e.g. measured step times."""

    @property
    def primary(self) -> Metric:
        return self.metrics[0]

    def variant(self, name: str) -> Variant:
        return next(v for v in self.variants if v.name == name)

    def block_of(self, seed: int) -> Block | None:
        """The block `seed` belongs to (None for a study without blocks)."""
        return next((b for b in self.blocks.values() if seed in b.seeds), None)

    def run_args(self, variant: Variant, seed: int) -> list[str]:
        """CLI arguments (after `fit`) that define one run, without the log-directory arguments."""
        args = ["--config", str(self.base)]
        block = self.block_of(seed)
        args += overrides_to_args({**self.overrides, **(block.overrides if block else {}), **variant.overrides})
        args += overrides_to_args({key: seed for key in self.seed_keys})
        return args

    def identity(self, variant: Variant, seed: int, base_text: bytes | None = None) -> str:
        """Which run this is: its arguments and the base config's text (the fingerprint of runs recorded before
        fingerprints covered checkpoints and source, and the key of the committed results). The base config is
        named by its path inside the repository (or its file name outside it), so a moved or second checkout
        recognises the same runs. `base_text`: the identity under another text of the base config (an earlier one,
        for `sweep.equivalence`)."""
        args = self.run_args(variant, seed)
        args[1] = portable_path(self.base)
        h = hashlib.sha256(json.dumps(args).encode())
        h.update(self.base.read_bytes() if base_text is None else base_text)
        return h.hexdigest()[:16]

    def fingerprint_parts(self, variant: Variant, seed: int) -> dict[str, Any]:
        """What the run depends on (`sweep.fingerprint`): arguments, config texts, checkpoint digests, source,
        library versions and CPU, and the study's inputs."""
        parts = {**fingerprint_parts(self.run_args(variant, seed)), "environment": environment()}
        if self.inputs:
            parts["inputs"] = input_digests(self.inputs)
        return parts

    def fingerprint(self, variant: Variant, seed: int) -> str:
        """Changes when anything the run depends on changes (`fingerprint_parts`), and only then."""
        return combine(self.fingerprint_parts(variant, seed))

    def with_settings(self, settings: dict[str, Any]) -> Study:
        """The study with config `settings` (dotted key -> value) applied to every run, e.g. from `--set`."""
        varied = {key for v in self.variants for key in v.overrides} | set(self.seed_keys)
        varied |= {key for b in self.blocks.values() for key in b.overrides}
        clash = sorted(set(settings) & varied)
        if clash:
            raise StudyError(f"{self.path}: --set cannot change {clash}: the study varies them (variants, seeds or "
                             f"blocks)")
        return Study(**{**self.__dict__, "overrides": {**self.overrides, **settings}})

    def with_seed_count(self, n: int) -> Study:
        """The study with `n` seeds: the first n of its seeds, extended by consecutive integers if needed."""
        if n < 1:
            raise StudyError(f"{self.path}: --seeds must be >= 1, got {n}")
        if self.blocks:  # n seeds per block, so that every block keeps its share
            short = [b.name for b in self.blocks.values() if len(b.seeds) < n]
            if short:
                raise StudyError(f"{self.path}: --seeds {n} is more than the seeds of block(s) {short}: with blocks, "
                                 f"--seeds counts seeds per block; add seeds to the study file")
            blocks = {name: Block(name, b.seeds[:n], b.overrides) for name, b in self.blocks.items()}
            return Study(**{**self.__dict__, "blocks": blocks,
                            "seeds": [s for b in blocks.values() for s in b.seeds]})
        seeds = list(self.seeds[:n])
        nxt = max(self.seeds) + 1
        while len(seeds) < n:
            seeds.append(nxt)
            nxt += 1
        out = Study(**{**self.__dict__, "seeds": seeds})
        return out


def _cli_value(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)


def overrides_to_args(overrides: dict[str, Any]) -> list[str]:
    """`{"trainer.max_steps": 200, "data.init_args.curriculum": [...]}` -> `["--trainer.max_steps=200", ...]`
    (structured values as JSON, None as null; `--key=value` so negative numbers are not read as flags)."""
    return [f"--{key}={_cli_value(value)}" for key, value in overrides.items()]


def _resolve_base(base: Any, study_path: Path) -> Path:
    if not isinstance(base, str) or not base:
        raise StudyError(f"{study_path}: `base` must be the path of a stage config (e.g. configs/pretrain.yaml)")
    p = Path(base)
    candidates = [p] if p.is_absolute() else [study_path.parent / p, Path.cwd() / p, REPO_ROOT / p]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise StudyError(f"{study_path}: base config {base!r} not found (looked in: "
                     f"{', '.join(str(c) for c in candidates)})")


def _check_overrides(where: str, overrides: Any) -> dict[str, Any]:
    if overrides is None:
        return {}
    if not isinstance(overrides, dict):
        raise StudyError(f"{where} must be a mapping of dotted config keys to values, e.g. "
                         f"{{trainer.max_steps: 200}}; got {type(overrides).__name__}")
    for key in overrides:
        if not isinstance(key, str) or not _KEY_RE.match(key):
            raise StudyError(f"{where}: {key!r} is not a dotted config key such as data.init_args.ordering")
    return dict(overrides)


def _variant_name(value: Any) -> str:
    name = _cli_value(value)
    if not _NAME_RE.match(name):
        raise StudyError(f"value {value!r} cannot name a run directory; use `variants: {{name: {{key: value}}}}`")
    return name


def _parse_metrics(path: Path, raw: Any, hib: Any) -> list[Metric]:
    if not raw:
        raise StudyError(f"{path}: `metrics` must list at least one TensorBoard scalar tag, e.g. [val/completion_acc]")
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list):
        raise StudyError(f"{path}: `metrics` must be a list of tags or {{tag: ..., higher_is_better: ...}} entries")
    if hib is not None and not isinstance(hib, (bool, dict)):
        raise StudyError(f"{path}: `higher_is_better` must be true/false (primary metric) or a mapping tag -> bool")
    out: list[Metric] = []
    for i, entry in enumerate(raw):
        if isinstance(entry, str):
            entry = {"tag": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("tag"), str) or not entry["tag"]:
            raise StudyError(f"{path}: metrics[{i}] must be a tag string or a mapping with a `tag`, got {entry!r}")
        extra = set(entry) - {"tag", "higher_is_better", "scale", "unit", "bounds"}
        if extra:
            raise StudyError(f"{path}: metrics[{i}]: unknown key(s) {sorted(extra)}; "
                             f"allowed: tag, higher_is_better, scale, unit, bounds")
        tag = entry["tag"]
        default = not tag.rsplit("/", 1)[-1].endswith(LOWER_IS_BETTER_SUFFIXES)
        if isinstance(hib, dict) and tag in hib:
            default = hib[tag]
        elif isinstance(hib, bool) and i == 0:
            default = hib
        better = entry.get("higher_is_better", default)
        if not isinstance(better, bool):
            raise StudyError(f"{path}: metrics[{i}].higher_is_better must be true or false")
        scale = entry.get("scale", 1.0)
        if not isinstance(scale, (int, float)) or scale <= 0:
            raise StudyError(f"{path}: metrics[{i}].scale must be a positive number")
        out.append(Metric(tag, better, float(scale), str(entry.get("unit", "")), _parse_bounds(path, i, entry)))
    tags = [m.tag for m in out]
    if len(set(tags)) != len(tags):
        raise StudyError(f"{path}: duplicate metric tags in {tags}")
    return out


def _parse_bounds(path: Path, i: int, entry: dict[str, Any]) -> tuple[float, float] | None:
    raw = entry.get("bounds")
    if raw is None:
        return None
    if not (isinstance(raw, (list, tuple)) and len(raw) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in raw) and raw[0] < raw[1]):
        raise StudyError(f"{path}: metrics[{i}].bounds must be [low, high] with low < high (e.g. [0, 1] for a rate), "
                         f"got {raw!r}")
    return float(raw[0]), float(raw[1])


def _parse_seeds(path: Path, raw: Any) -> tuple[list[int], bool]:
    if isinstance(raw, bool) or raw is None:
        raise StudyError(f"{path}: `seeds` must be a count (e.g. 10) or a list of integers")
    if isinstance(raw, int):
        if raw < 1:
            raise StudyError(f"{path}: seeds is {raw}; a study needs at least 1 seed (10 to have a chance of "
                             f"p < 0.05 with the exact sign-flip test needs >= 6)")
        return list(range(raw)), True
    if isinstance(raw, list):
        if not raw:
            raise StudyError(f"{path}: `seeds` is an empty list; a study needs at least 1 seed")
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in raw):
            raise StudyError(f"{path}: `seeds` must contain integers only, got {raw}")
        if len(set(raw)) != len(raw):
            raise StudyError(f"{path}: duplicate seeds in {raw}")
        return list(raw), False
    raise StudyError(f"{path}: `seeds` must be a count or a list of integers, got {raw!r}")


def _parse_blocks(path: Path, raw: Any) -> dict[str, Block]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not raw:
        raise StudyError(f"{path}: `blocks` must map block names to {{seeds: [...], overrides: {{...}}}}")
    out: dict[str, Block] = {}
    seen: set[int] = set()
    for name, spec in raw.items():
        name = str(name)
        if not isinstance(spec, dict) or set(spec) - {"seeds", "overrides"} or "seeds" not in spec:
            raise StudyError(f"{path}: blocks.{name} must be {{seeds: [...], overrides: {{...}}}}, got {spec!r}")
        seeds, _ = _parse_seeds(path, spec["seeds"] if isinstance(spec["seeds"], list) else None)
        clash = seen & set(seeds)
        if clash:
            raise StudyError(f"{path}: blocks.{name}: seeds {sorted(clash)} belong to another block too")
        seen |= set(seeds)
        out[name] = Block(name, tuple(seeds), _check_overrides(f"{path}: blocks.{name}.overrides",
                                                               spec.get("overrides")))
    return out


def _parse_score_at(path: Path, raw: dict[str, Any], base: Path, overrides: dict[str, Any],
                    variants: Sequence[Variant]) -> ScoreAt | None:
    """`score_at:`, with its completions checked in every variant (`sweep.score_at.completions_at`)."""
    try:
        score_at = parse_score_at(str(path), raw.get("score_at"))
        if score_at is None or score_at.completions is None:
            return score_at
        for v in variants:
            n = completions_at(base, {**overrides, **v.overrides}, score_at.evaluation)
            if n != score_at.completions:
                raise ValueError(f"{path}: score_at: variant {v.name!r} reaches evaluation {score_at.evaluation} "
                                 f"after {n} training completions, not {score_at.completions}")
    except ValueError as err:
        raise StudyError(str(err)) from None
    return score_at


def load_study(path: str | Path, seeds: int | None = None) -> Study:
    """Read and check a study file (not yet the base config: see `validate_config`). `seeds` overrides the count."""
    path = Path(path)
    if not path.is_file():
        raise StudyError(f"study file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise StudyError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise StudyError(f"{path}: a study file must be a YAML mapping with base, variable/values (or variants), "
                         f"control, seeds and metrics; got {type(raw).__name__}")
    unknown = set(raw) - KNOWN_KEYS
    if unknown:
        raise StudyError(f"{path}: unknown key(s) {sorted(unknown)}; allowed: {sorted(KNOWN_KEYS)}")
    for key in ("base", "metrics"):
        if key not in raw:
            raise StudyError(f"{path}: missing required key `{key}`")
    if ("seeds" in raw) == ("blocks" in raw):
        raise StudyError(f"{path}: give exactly one of `seeds` (a count or a list) or `blocks` (groups of seeds)")
    name = str(raw.get("name") or path.stem)
    if not _NAME_RE.match(name):
        raise StudyError(f"{path}: study name {name!r} must be usable as a directory name")
    base = _resolve_base(raw["base"], path)
    overrides = _check_overrides(f"{path}: overrides", raw.get("overrides"))

    variable = raw.get("variable")
    if variable is not None and (not isinstance(variable, str) or not _KEY_RE.match(variable)):
        raise StudyError(f"{path}: `variable` must be a dotted config key such as data.init_args.ordering, "
                         f"got {variable!r}")
    has_values, has_variants = "values" in raw, "variants" in raw
    if has_values == has_variants:
        raise StudyError(f"{path}: give exactly one of `values` (with `variable`) or `variants` (name -> overrides)")
    variants: list[Variant] = []
    if has_values:
        if variable is None:
            raise StudyError(f"{path}: `values` needs `variable` (the dotted config key they are assigned to)")
        values = raw["values"]
        if not isinstance(values, list) or len(values) < 2:
            raise StudyError(f"{path}: `values` must list at least 2 values of {variable}")
        if variable in overrides:
            raise StudyError(f"{path}: the variable {variable} also appears in `overrides`")
        variants = [Variant(_variant_name(v), {variable: v}) for v in values]
    else:
        spec = raw["variants"]
        if not isinstance(spec, dict) or len(spec) < 2:
            raise StudyError(f"{path}: `variants` must map at least 2 variant names to override mappings")
        for vname, vover in spec.items():
            vname = str(vname)
            if not _NAME_RE.match(vname):
                raise StudyError(f"{path}: variant name {vname!r} must be usable as a directory name")
            variants.append(Variant(vname, _check_overrides(f"{path}: variants.{vname}", vover)))
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise StudyError(f"{path}: duplicate variant names {names}")

    control = raw.get("control", names[0])
    control = _cli_value(control) if not isinstance(control, str) else control
    if control not in names:
        raise StudyError(f"{path}: control {control!r} is not one of the variants {names}")

    blocks = _parse_blocks(path, raw.get("blocks"))
    if blocks:
        seed_list, from_count = [s for b in blocks.values() for s in b.seeds], False
    else:
        seed_list, from_count = _parse_seeds(path, raw["seeds"])
    seed_keys = raw.get("seed_keys", list(DEFAULT_SEED_KEYS))
    if isinstance(seed_keys, str):
        seed_keys = [seed_keys]
    if not isinstance(seed_keys, list) or not all(isinstance(k, str) and _KEY_RE.match(k) for k in seed_keys):
        raise StudyError(f"{path}: `seed_keys` must be a list of dotted config keys")
    metrics = _parse_metrics(path, raw["metrics"], raw.get("higher_is_better"))
    try:
        claims = parse_claims(path, raw.get("claims"), names, control, [m.tag for m in metrics])
    except ValueError as err:
        raise StudyError(str(err)) from None
    expected = raw.get("expected_minutes")
    if expected is not None and (isinstance(expected, bool) or not isinstance(expected, (int, float))
                                 or expected <= 0):
        raise StudyError(f"{path}: `expected_minutes` must be a positive number (wall minutes with 2 workers)")
    study = Study(
        name=name, path=path, base=base, overrides=overrides, variable=variable, variants=variants,
        control=control, seeds=seed_list, metrics=metrics, seed_keys=tuple(seed_keys),
        description=str(raw.get("description") or "").strip(), budget=str(raw.get("budget") or "").strip(),
        tutorial=str(raw.get("tutorial") or "").strip(), seeds_from_count=from_count, raw=raw, claims=claims,
        expected_minutes=None if expected is None else float(expected),
        regime=str(raw.get("regime") or "").strip(), blocks=blocks, score_at=_parse_score_at(path, raw, base,
                                                                                           overrides, variants),
    )
    inputs = raw.get("inputs") or []
    if not isinstance(inputs, list) or not all(isinstance(x, str) for x in inputs):
        raise StudyError(f"{path}: `inputs` must be a list of repository paths")
    study.inputs = tuple(inputs)
    study.cpu = str(raw.get("cpu") or "").strip()
    try:
        study.equivalences = parse_equivalences(str(path), raw.get("equivalences"))
    except ValueError as err:
        raise StudyError(str(err)) from None
    if seeds is not None:
        study = study.with_seed_count(seeds)
    return study


# --- validating against the real config parser ---------------------------------------------------------------------
def _short_error(err: BaseException) -> str:
    """The informative lines of a jsonargparse/constructor error (drops the Union-subtype boilerplate)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    skip = ("Does not validate against any of the Union subtypes", "Subtypes:", "Errors:",
            "- Expected a <class 'NoneType'>", "Given value type:", "Given value:")
    keep = [ln.removeprefix("- ").rstrip(":") for ln in lines if not ln.startswith(skip)]
    return "; ".join(keep[:6]) or type(err).__name__


def _unknown_keys_hint(check: Any, base_args: list[str], overrides: dict[str, Any]) -> list[str]:
    """Which single override keys fail on their own (to name the culprit)."""
    bad = []
    for key, value in overrides.items():
        try:
            check(base_args + overrides_to_args({key: value}))
        except (Exception, SystemExit):  # noqa: BLE001 - any failure names the key
            bad.append(key)
    return bad


def validate_config(study: Study, log_args: Sequence[str] = ()) -> None:
    """Parse the base config with the common overrides, each variant's overrides, the seed keys and `log_args`
    through the project's CLI parser; raise StudyError naming the variant and key on failure."""
    import io
    import warnings
    from contextlib import redirect_stderr

    with warnings.catch_warnings(), redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        from glm_lightning.stage_cli import check_config as check
        base_args = ["--config", str(study.base)]
        try:
            check(base_args)
        except (Exception, SystemExit) as err:  # noqa: BLE001
            raise StudyError(f"{study.path}: the base config {study.base} does not parse: "
                             f"{_short_error(err)}") from None
        for variant in study.variants:
            args = study.run_args(variant, study.seeds[0]) + list(log_args)
            try:
                check(args)
            except (Exception, SystemExit) as err:  # noqa: BLE001
                every = {**study.overrides, **variant.overrides, **{k: study.seeds[0] for k in study.seed_keys}}
                culprits = _unknown_keys_hint(check, base_args, every)
                which = f" (offending key(s): {', '.join(culprits)})" if culprits else ""
                raise StudyError(f"{study.path}: variant {variant.name!r}: the overrides do not form a valid "
                                 f"config of {study.base.name}{which}: {_short_error(err)}") from None
        for block in list(study.blocks.values())[1:]:  # the first block was checked with every variant above
            try:
                check(study.run_args(study.variant(study.control), block.seeds[0]) + list(log_args))
            except (Exception, SystemExit) as err:  # noqa: BLE001
                raise StudyError(f"{study.path}: block {block.name!r}: its overrides do not form a valid config of "
                                 f"{study.base.name}: {_short_error(err)}") from None
