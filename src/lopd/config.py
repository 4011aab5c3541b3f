"""Loading a run's config: defaults <- YAML files (with their includes) <- dotted command-line overrides.

    lopd train --config configs/grpo.yaml train.max_rollouts=256 model.lora.r=8

The tree itself (dataclasses with help text, choices, ranges) is `lopd.schema`; its names can be imported from
here too. Built on OmegaConf structured configs, which type-check every value against those dataclasses. Our
part is only the error messages: an unknown key names the valid keys next to it, a wrong value names the
expected type or choices, and a key that came from a YAML file names the file and line.
"""

from __future__ import annotations

import copy
import difflib
import enum
import functools
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from lopd import schema
from lopd.errors import ConfigError
from lopd.schema import Config, validate


def __getattr__(name: str) -> Any:
    """`from lopd.config import Config, DistillTarget, ...`: the schema's names, where they were before it had
    its own module (and where checkpoints pickled before then find them)."""
    try:
        return getattr(schema, name)
    except AttributeError:
        raise AttributeError(f"module 'lopd.config' has no attribute '{name}'") from None



def _valid_keys(node_type: type, path: list[str]) -> tuple[str, list[str]]:
    """The dataclass reached by following `path` as far as it goes, and its keys."""
    cls, walked = node_type, []
    for part in path:
        sub = next((f for f in fields(cls) if f.name == part), None)
        if sub is None or not is_dataclass(sub.type if isinstance(sub.type, type) else _resolve(cls, sub)):
            break
        cls, walked = _resolve(cls, sub), walked + [part]
    return ".".join(walked), [f.name for f in fields(cls)]


def _resolve(cls: type, f) -> Any:
    import typing

    return typing.get_type_hints(cls)[f.name]


def _yaml_line(path: Path, dotted: str) -> int | None:
    """Line of `dotted` in a YAML file (1-based), found by walking the composed node tree."""
    try:
        node = yaml.compose(path.read_text())
    except yaml.YAMLError:
        return None
    for part in dotted.split("."):
        if not isinstance(node, yaml.MappingNode):
            return None
        match = next(((k, v) for k, v in node.value if k.value == part), None)
        if match is None:
            return None
        key, node = match
    return key.start_mark.line + 1


def _explain(e: OmegaConfBaseException, source: str, yaml_path: Path | None = None) -> ConfigError:
    key = getattr(e, "full_key", None) or ""
    where = source
    if yaml_path is not None and key and (line := _yaml_line(yaml_path, key)):
        where = f"{yaml_path}:{line}"
    if isinstance(e, ConfigKeyError) or "not in" in str(e):
        parent, valid = _valid_keys(Config, key.split(".")[:-1])
        guess = difflib.get_close_matches(key, dotted_keys(), n=1, cutoff=0.6)
        hint = f"; did you mean '{guess[0]}'?" if guess else ""
        return ConfigError(f"{where}: unknown config key '{key}'{hint} (valid keys under "
                           f"'{parent or '<root>'}': {', '.join(valid)})")
    message = str(e).splitlines()[0]
    if isinstance(e, ValidationError):
        return ConfigError(f"{where}: bad value for '{key}': {message}")
    return ConfigError(f"{where}: {message}" + (f" (key '{key}')" if key else ""))


def dotted_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every key of the tree, sections included ('train', 'train.max_rollouts', ...): what an unknown key
    is matched against for "did you mean"."""
    import typing

    out = []
    for name, t in typing.get_type_hints(cls).items():
        out.append(prefix + name)
        if is_dataclass(t):
            out += dotted_keys(t, f"{prefix}{name}.")
    return out


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A dataclass's field types, resolved once per class."""
    import typing

    return typing.get_type_hints(cls) if is_dataclass(cls) else {}


def _field_type(cls: type, dotted: list[str]) -> Any:
    """The declared type of a dotted key under dataclass `cls` (None if there is no such key)."""
    for part in dotted:
        hints = _hints(cls)
        if part not in hints:
            return None
        cls = hints[part]
    return cls


def _is_list(t: Any) -> bool:
    import typing

    return t is list or typing.get_origin(t) is list


def _listify(data: Any, cls: type = None, prefix: tuple = ()) -> Any:
    """A scalar given for a list-valued key becomes a one-element list (`env.eval_splits: test`)."""
    cls = cls or Config
    if isinstance(data, dict):
        out = {}
        for k, v in data.items():
            t = _field_type(cls, [*prefix, str(k)])
            out[k] = [v] if _is_list(t) and not isinstance(v, (list, tuple, dict)) and v is not None else \
                _listify(v, cls, (*prefix, str(k))) if isinstance(v, dict) and is_dataclass(t) else v
        return out
    return data


def _file_layers(path: Path, seen: tuple = ()) -> list[tuple[Path, DictConfig]]:
    """A YAML file as the layers it merges, in order: its `include: [files]` (relative to it, or bundled
    names) first, then its own keys."""
    if path.resolve() in seen:
        raise ConfigError(f"{path}: include cycle ({' -> '.join(str(p) for p in seen)})")
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{line}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must be a mapping of sections, got {type(data).__name__}")
    includes = data.pop("include", [])
    layers = []
    for inc in [includes] if isinstance(includes, str) else includes:
        layers += _file_layers(_include_path(path, str(inc)), seen + (path.resolve(),))
    try:
        return layers + [(path, OmegaConf.create(_listify(data)))]
    except OmegaConfBaseException as e:
        raise _explain(e, str(path), path) from None


CONFIG_DIR = Path(__file__).parent / "configs"


def _bundled(name: str) -> Path | None:
    """lopd/configs/NAME.yaml if NAME names a bundled config ('grpo'), else None."""
    path = CONFIG_DIR / f"{name}.yaml"
    return path if "/" not in name and path.is_file() else None


def _bundled_names() -> str:
    return ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))


def _include_path(including: Path, name: str) -> Path:
    """What `include: NAME` in `including` means: a file relative to it, else a bundled config's name
    (`include: grpo`, as `--config grpo`)."""
    path = including.parent / name
    if path.is_file():
        return path
    stem = Path(name).stem if Path(name).suffix in (".yaml", ".yml") else name
    if "/" not in name and (bundled := _bundled(stem)) is not None:  # `include: grpo` or `include: grpo.yaml`, as `--config` takes them
        return bundled
    line = _yaml_line(including, "include")
    bundled_too = "" if "/" in name else f" and no bundled config ({_bundled_names()})"
    raise ConfigError(f"{including}{f':{line}' if line else ''}: include '{name}': no such file {path}{bundled_too}")


def config_path(name: str | Path | None) -> Path | None:
    """A config file path, or the name of a bundled one ('grpo' -> lopd/configs/grpo.yaml)."""
    if name is None:
        return None
    path = Path(name)
    if path.is_file():
        return path
    if (bundled := _bundled(path.stem if path.suffix in (".yaml", ".yml") else str(name))) is not None \
            and path.parent == Path("."):  # 'grpo' or 'grpo.yaml' with no such file here: the bundled one
        return bundled
    if path.suffix in (".yaml", ".yml"):
        return path
    raise ConfigError(f"--config: '{name}' is neither a file nor a bundled config ({_bundled_names()})")


@functools.cache
def _defaults() -> DictConfig:
    """The schema with its defaults, built from the dataclasses once per process (half of a load's time)."""
    return OmegaConf.structured(Config)


def load_config(path: str | Path | list | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file(s) (each after its includes, in order) <- dotted overrides, type-checked.
    A path may also name a bundled config ('lopd', 'grpo', ...)."""
    layers = [layer for p in (path if isinstance(path, list) else [path]) if p is not None
              for layer in _file_layers(config_path(p))]
    try:  # one merge (each merge copies the whole config); on an error, layer by layer to name the file
        cfg = OmegaConf.merge(_defaults(), *(data for _, data in layers))
    except OmegaConfBaseException:
        cfg = copy.deepcopy(_defaults())
        for file, data in layers:
            try:
                cfg = OmegaConf.merge(cfg, data)
            except OmegaConfBaseException as e:
                raise _explain(e, str(file), file) from None
        raise
    items = []
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"command line: override '{item}' is not of the form key=value")
        key, _, value = item.partition("=")
        if _is_list(_field_type(Config, key.split("."))) and not value.strip().startswith("["):
            item = f"{key}=[{value}]"  # env.eval_splits=test means [test]
        items.append(item)
    try:  # one merge (each merge copies the whole config); on an error, item by item to name the bad one
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(items)) if items else cfg
    except OmegaConfBaseException:
        for item in items:
            try:
                cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
            except OmegaConfBaseException as e:
                raise _explain(e, f"command line '{item}'") from None
        raise
    try:
        return validate(OmegaConf.to_object(cfg))  # type: ignore[arg-type]
    except OmegaConfBaseException as e:
        raise _explain(e, "config") from None


def with_overrides(cfg: Config, overrides: list[str]) -> Config:
    """`cfg` with dotted overrides applied (type-checked like `load_config`'s)."""
    base = OmegaConf.structured(cfg)
    for item in overrides:
        key, _, value = item.partition("=")
        if _is_list(_field_type(Config, key.split("."))) and not value.strip().startswith("["):
            item = f"{key}=[{value}]"
        try:
            base = OmegaConf.merge(base, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as e:
            raise _explain(e, f"override '{item}'") from None
    return validate(OmegaConf.to_object(base))  # type: ignore[arg-type]


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)  # type: ignore[return-value]


def _comment_help(cls: type) -> dict[str, str]:
    """Trailing `# comments` of a dataclass's fields (the env configs document their fields that way)."""
    import inspect
    import io
    import tokenize

    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    out, line_names = {}, {}
    for i, line in enumerate(source.splitlines(), 1):
        head = line.strip().split(":", 1)[0]
        if head.isidentifier() and ":" in line:
            line_names[i] = head
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and tok.start[0] in line_names:
            out[line_names[tok.start[0]]] = tok.string.lstrip("#").strip()
    return out


def describe(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every leaf: what `lopd train --help` lists."""
    import typing

    rows = []
    hints = typing.get_type_hints(cls)
    instance = cls()
    comments = _comment_help(cls)
    for f in fields(cls):
        value = getattr(instance, f.name)
        if is_dataclass(hints[f.name]):
            rows += describe(hints[f.name], f"{prefix}{f.name}.")
        else:
            shown = value.value if isinstance(value, enum.Enum) else value
            choices = hints[f.name]
            help_text = f.metadata.get("help", "") or comments.get(f.name, "")
            if isinstance(choices, type) and issubclass(choices, enum.Enum):
                help_text += f" [{'|'.join(c.value for c in choices)}]"
            rows.append((prefix + f.name, as_override(shown), help_text))
    return rows


def as_override(value: Any) -> str:
    """A value as it is typed after `key=` on the command line: true, null, '', [test, transfer]."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(as_override(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {as_override(v)}" for k, v in value.items()) + "}"
    return "''" if value == "" else str(value)
