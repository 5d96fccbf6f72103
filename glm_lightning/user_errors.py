"""User errors as one clear line: which exceptions are the user's (a bad value, a missing file, an unknown config
key) rather than a bug, and how to say them in one line, with the closest known key for a misspelt one."""

from __future__ import annotations

import dataclasses
import inspect
import re
from difflib import get_close_matches
from functools import lru_cache
from pathlib import Path

UNKNOWN_KEY = re.compile(r"""(?:Option|Key|key) ['"]([\w.@/-]+)['"] (?:is not accepted|is not expected)"""
                         r"""|Unrecognized arguments:\s*(\S+)|[Nn]o action for key ['"]([\w.@/-]+)['"]"""
                         r"""|does not accept option ['"]([\w.@/-]+)['"]""")


PARSER_KEY = re.compile(r'^(\s*)(?:-\s+)?Parser key "([\w.]+)":')
EXPECTED_TYPE = re.compile(r"Expected a <class '([\w.]+)'>")
GIVEN_VALUE = re.compile(r"(?:Got value|Given value): (.*)$")
UNKNOWN_MODEL_FIELDS = re.compile(r"unknown GLMConfig field\(s\) \[([^\]]*)\]")
BASE_CLASS_PATH = re.compile(r"""Parser key "(model|data)":(?:.|\n)*class_path 'lightning\.Lightning(?:Data)?Module'"""
                             r"""|Option '(?:\w+\.)?(model|data)' is required""")
OVERLAY_EXAMPLE = "--config configs/vision_scratch.yaml --config configs/vision_direct.yaml"

WRAPPER_LINES = ("Parser key", "Does not validate", "Subtypes:", "Errors:", "Expected a <class", "Given value",
                 "Problem with given class_path")
"""Lines jsonargparse wraps around the error raised inside a class's __init__."""


def is_user_error(err: BaseException) -> bool:
    """Errors the user can fix from the message alone (bad values, files, keys); other errors keep their traceback."""
    if isinstance(err, (ValueError, FileNotFoundError, IsADirectoryError, KeyError)):
        return True  # before importing the libraries below: an early error stays fast
    import sys

    if "jsonargparse" in sys.modules:
        from jsonargparse import ArgumentError

        if isinstance(err, ArgumentError):
            return True
    if "lightning" in sys.modules:
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        return isinstance(err, MisconfigurationException)
    return False


def _signature_names(obj: object) -> set[str]:
    try:
        return {p for p in inspect.signature(obj).parameters if p not in ("self", "args", "kwargs")}
    except (TypeError, ValueError):
        return set()


@lru_cache(maxsize=1)
def known_keys() -> tuple[str, ...]:
    """Every config key name the stage CLI accepts (the last part of a dotted key)."""
    import lightning.pytorch as pl
    from lightning.pytorch import callbacks as pl_callbacks
    from lightning.pytorch.loggers import TensorBoardLogger

    import callbacks
    import datamodules
    import glm_lightning.modules as modules
    from glm_lightning.evaluation import VerifierSettings
    from glm_lightning.rl import config as rl_config

    names = {"trainer", "model", "data", "seed_everything", "ckpt_path", "config", "print_config", "optimizer",
             "lr_scheduler", "last_checkpoint", "preflight", "class_path", "init_args"}
    classes = [pl.Trainer, TensorBoardLogger, pl_callbacks.ModelCheckpoint, pl_callbacks.EarlyStopping,
               pl_callbacks.LearningRateMonitor]
    for module in (callbacks, datamodules, modules):
        classes += [obj for obj in vars(module).values() if inspect.isclass(obj)]
    for cls in classes:
        for klass in inspect.getmro(cls):
            if klass.__module__.split(".")[0] in ("glm_lightning", "callbacks", "datamodules") or klass in classes:
                names |= _signature_names(klass)
    for holder in (VerifierSettings, *vars(rl_config).values()):
        if dataclasses.is_dataclass(holder):
            names |= {f.name for f in dataclasses.fields(holder)}
    return tuple(sorted(names))


def closest_key(name: str) -> str | None:
    """The known key most like `name` (its last dotted part), with the same dotted prefix."""
    prefix, _, leaf = name.rpartition(".")
    match = get_close_matches(leaf, known_keys(), n=1, cutoff=0.6)
    if not match:
        return None
    return f"{prefix}.{match[0]}" if prefix else match[0]


def wrong_type(text: str) -> str | None:
    """`KEY: expected TYPE, got VALUE` for a jsonargparse type error (None if `text` is none): the innermost key,
    dotted through the class_path it sits under (`data.init_args.batch_size`), the types it takes, the value given."""
    lines = text.splitlines()
    keys = [(i, len(m.group(1)), m.group(2)) for i, ln in enumerate(lines) if (m := PARSER_KEY.match(ln))]
    if not keys or not EXPECTED_TYPE.search(text):
        return None
    start, indent, _ = keys[-1]
    block = [lines[start]]
    for line in lines[start + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        block.append(line)
    types = list(dict.fromkeys(EXPECTED_TYPE.findall("\n".join(block))))
    if not [t for t in types if t != "NoneType"]:  # "Expected a NoneType" alone wraps an error raised in __init__
        return None
    parts, previous = [], None
    for i, _, name in keys:
        if previous is not None:
            parts.append("init_args" if any("class_path" in ln for ln in lines[previous:i]) else "")
        parts.append(name)
        previous = i
    key = ".".join(p for p in parts if p)
    value = next((m.group(1).strip() for ln in block if (m := GIVEN_VALUE.search(ln))), None)
    names = [t.rsplit(".", 1)[-1] for t in types if t != "NoneType"] + (["null"] if "NoneType" in types else [])
    line = f"{key}: expected {' or '.join(names)}" + (f", got {value!r}" if value is not None else "")
    if value and value.startswith("{") and re.search(r":\S", value):
        line += " (in YAML a mapping needs a space after each colon: {d_model: 64})"
    return line


def model_field_suggestion(text: str) -> str | None:
    """The closest GLMConfig field for each unknown `model_overrides` key, as `; did you mean 'x'?`."""
    found = UNKNOWN_MODEL_FIELDS.search(text)
    if not found:
        return None
    from glm_lightning.model.config import GLMConfig

    fields = [f.name for f in dataclasses.fields(GLMConfig)]
    names = re.findall(r"'([^']*)'", found.group(1))
    close = [m[0] for n in names if (m := get_close_matches(n, fields, n=1, cutoff=0.6))]
    return f"; did you mean {' / '.join(repr(c) for c in close)}?" if close else None


TOP_LEVEL_KEYS = ("seed_everything", "trainer", "model", "data", "ckpt_path", "optimizer", "lr_scheduler",
                  "last_checkpoint", "preflight", "final_validation", "threads", "weights_only")
"""The keys a stage config file may hold at its top level (the stage CLI's sections and options)."""


def config_files(argv: list[str]) -> list[str]:
    """The `--config FILE` / `--config=FILE` values of a command line, in order."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif arg.startswith("--config="):
            out.append(arg.split("=", 1)[1])
    return out


def _flat_keys(node: object, prefix: str = "") -> set[str]:
    """Every dotted key path of a YAML mapping, also with `init_args.` left out (how errors name them)."""
    keys: set[str] = set()
    if isinstance(node, dict):
        for k, v in node.items():
            path = f"{prefix}{k}"
            keys |= {path, path.replace(".init_args.", ".")} | _flat_keys(v, path + ".")
    elif isinstance(node, list):
        for item in node:
            keys |= _flat_keys(item, prefix)
    return keys


def file_with_key(key: str, argv: list[str]) -> str | None:
    """The last `--config` file of `argv` that sets `key` (dotted, with or without `init_args`), else None."""
    import yaml

    wanted = {key, key.replace(".init_args.", ".")}
    for path in reversed(config_files(argv)):
        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError):
            continue
        if wanted & _flat_keys(data):
            return path
    return None


def check_config_files(argv: list[str], schema: dict | None = None) -> None:
    """Fast checks of every `--config` file before the stage CLI is imported (seconds of imports): a file that is
    empty, not YAML, not a mapping, has an unknown top-level key, or (with the cached `schema` of
    `glm_lightning.help_cache`) an unknown key in a section, is a one-line ValueError naming the file and the
    closest key."""
    import yaml

    class_paths: dict[str, str] = {}
    for path in config_files(argv):
        file = Path(path)
        if not file.is_file():
            continue  # the parser's own error ("does not exist") names it
        try:
            data = yaml.safe_load(file.read_text())
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ValueError(f"{path} is not valid YAML{where}: {problem}") from None
        if data is None:
            raise ValueError(f"{path} is empty: a config file is a YAML mapping of sections (trainer:, model:, "
                             "data:, ...), e.g. configs/pretrain.yaml")
        if not isinstance(data, dict):
            raise ValueError(f"{path} is not a YAML mapping (it holds a {type(data).__name__}): a config file maps "
                             "sections (trainer:, model:, data:, ...) to their settings")
        for key in data:
            if key not in TOP_LEVEL_KEYS:
                match = get_close_matches(str(key), TOP_LEVEL_KEYS, n=1, cutoff=0.6)
                hint = f"; did you mean {match[0]!r}?" if match else f" (sections: {', '.join(TOP_LEVEL_KEYS)})"
                raise ValueError(f"unknown config key {str(key)!r} in {path}{hint}")
        if schema is not None:
            check_section_keys(data, path, schema, class_paths)
    if schema is not None:
        check_argument_keys(argv, schema, class_paths)


def check_argument_keys(argv: list[str], schema: dict, class_paths: dict[str, str]) -> None:
    """`--trainer.KEY`, `--SECTION.KEY` and `--model/data.init_args.KEY` options of the command line against the
    cached schema, the model/data class taken from `--model CLASS` or the config files (`class_paths`)."""
    pending: dict[str, str] = dict(class_paths)
    for i, arg in enumerate(argv):
        if not arg.startswith("--") or "+=" in arg:
            continue
        key = arg[2:].split("=", 1)[0]
        parts = key.split(".")
        if len(parts) == 1 and parts[0] in ("model", "data") and i + 1 < len(argv) and "=" not in arg:
            pending[parts[0]] = argv[i + 1]  # `--model CLASS`
            continue
        types = schema.get("types", {})
        if len(parts) == 2 and parts[0] == "trainer":
            known, kind = schema["trainer"], types.get("trainer", {}).get(parts[1])
        elif len(parts) == 2 and parts[0] in schema["sections"]:
            known, kind = schema["sections"][parts[0]], types.get("sections", {}).get(parts[0], {}).get(parts[1])
        elif len(parts) == 3 and parts[0] in ("model", "data") and parts[1] == "init_args":
            cls = pending.get(parts[0], "")
            known, kind = schema["classes"].get(cls), types.get("classes", {}).get(cls, {}).get(parts[2])
        else:
            continue
        if known is not None and parts[-1] not in known:
            raise _unknown(key, known, None)
        raw = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else None)
        if kind is not None and raw is not None:
            import yaml

            try:
                value = yaml.safe_load(raw)
            except yaml.YAMLError:
                continue  # the parser says what is wrong with it
            check_value(key, value, kind, None, shown=raw)


def check_value(key: str, value: object, kind: list | None, where: str | None, shown: object = None) -> None:
    """A value of a key annotated int, float or bool (optionally None) that cannot be one, in the parser's words
    (`data.init_args.batch_size: expected int, got '1.5'`), plus the file that holds it."""
    if kind is None:
        return
    name, nullable = kind
    ok = (value is None and nullable) or (
        name == "int" and ((isinstance(value, int) and not isinstance(value, bool))
                           or (isinstance(value, str) and value.strip().lstrip("+-").isdigit()))) or (
        name == "float" and ((isinstance(value, (int, float)) and not isinstance(value, bool))
                             or (isinstance(value, str) and _is_float(value)))) or (
        name == "bool" and (isinstance(value, bool) or str(value).lower() in ("true", "false")))
    if not ok:
        got = str(shown if shown is not None else value)
        expected = " or ".join([name, *(["null"] if nullable else [])])
        raise ValueError(f"{key}: expected {expected}, got {got!r}" + (f" (in {where})" if where else ""))


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _unknown(key: str, known: list[str], where: str | None) -> ValueError:
    """The parser's own wording (`unknown config key 'k'; did you mean 'x'?`), plus the file that holds the key."""
    leaf = key.rpartition(".")[2]
    match = get_close_matches(leaf, known, n=1, cutoff=0.6)
    suggestion = f"{key.rpartition('.')[0]}.{match[0]}" if match and "." in key else (match[0] if match else None)
    return ValueError(f"unknown config key {key!r}" + (f" in {where}" if where else "")
                      + (f"; did you mean {suggestion!r}?" if suggestion else ""))


def check_section_keys(data: dict, path: str, schema: dict, class_paths: dict[str, str]) -> None:
    """The keys inside `trainer:`, the always-on sections and the `init_args` of a project class named by
    `class_path` (here or in an earlier file: `class_paths` carries them across a command's files), checked
    against the cached schema (`help_cache`). A class the schema does not know is left to the parser."""
    types = schema.get("types", {})
    trainer = data.get("trainer")
    if isinstance(trainer, dict):
        for key in trainer:
            if key not in schema["trainer"]:
                raise _unknown(f"trainer.{key}", schema["trainer"], path)
            check_value(f"trainer.{key}", trainer[key], types.get("trainer", {}).get(key), path)
    for section, known in schema["sections"].items():
        if isinstance(data.get(section), dict):
            for key in data[section]:
                if key not in known:
                    raise _unknown(f"{section}.{key}", known, path)
                check_value(f"{section}.{key}", data[section][key], types.get("sections", {}).get(section, {}).get(key),
                            path)
    for section in ("model", "data"):
        node = data.get(section)
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("class_path"), str):
            class_paths[section] = node["class_path"]
        known = schema["classes"].get(class_paths.get(section, ""))
        init = node.get("init_args")
        if known is None or not isinstance(init, dict):
            continue
        class_types = types.get("classes", {}).get(class_paths.get(section, ""), {})
        for key in init:
            if key not in known:
                raise _unknown(f"{section}.init_args.{key}", known, path)
            check_value(f"{section}.init_args.{key}", init[key], class_types.get(key), path)


def describe(err: BaseException, argv: list[str] | None = None) -> str:
    """One line: the message's core (the innermost reason of a config error), plus the closest key if misspelt and
    the config file that holds it (from `argv`'s `--config` files)."""
    line = _describe(err)
    found = re.match(r"unknown config key '([\w.@/-]+)'", line)
    if found and argv:
        where = file_with_key(found.group(1), argv)
        if where and where not in line:
            line = line.replace(f"'{found.group(1)}'", f"'{found.group(1)}' in {where}", 1)
    return line


def _describe(err: BaseException) -> str:
    """One line: the message's core (the innermost reason of a config error), plus the closest key if misspelt."""
    text = str(err) if not isinstance(err, KeyError) else str(err.args[0] if err.args else err)
    base = BASE_CLASS_PATH.search(text)
    if base:
        section = base.group(1) or base.group(2)
        return (f"the config given names no {section}.class_path: is it an overlay? Give its base config first, "
                f"e.g. {OVERLAY_EXAMPLE}")
    typed = wrong_type(text)
    if typed and not UNKNOWN_KEY.search(text):
        return typed
    found = UNKNOWN_KEY.search(text)
    where = re.search(r'Parser key "([\w.]+)"', text)
    section = where.group(1) if where else ""
    if section in ("model", "data"):
        section += ".init_args"
    if found:
        key = next(g for g in found.groups() if g).lstrip("-").split("=")[0]
        full = f"{section}.{key}" if section and not key.startswith(section.split(".")[0] + ".") else key
        suggestion = closest_key(full)
        line = f"unknown config key {full!r}"
        return f"{line}; did you mean {suggestion!r}?" if suggestion and suggestion != full else line
    lines = [re.sub(r"^\s*-\s+", "", ln).strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln]
    reasons = [ln for ln in lines if not ln.startswith(WRAPPER_LINES)]
    core = " ".join(" ".join(reasons or lines).split())
    return core + (model_field_suggestion(core) or "")
