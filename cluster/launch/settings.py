"""The config tree as flags and YAML keys, read in one place.

Every field declared with `cluster.config.setting(...)` in the tree under a root dataclass
(`ClusterConfig` for serve and chat, `EngineConfig` for generate) is one `Setting`: one flag, one
YAML key (the flag without its dashes; `_` and `-` alike), its default and help from the field.
Values come from the field's default, then the YAML file, then the command line; the tree is built
bottom-up and every refusal (`ConfigError`) is reported as a `SettingError` naming the flag or the
YAML file, line and key the value came from. Nothing here starts anything.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass
from pathlib import Path

import yaml

from cluster.config import ConfigError


class SettingError(ValueError):
    """A value refused before anything started: `where` is a flag or `FILE:LINE: key`."""

    def __init__(self, where: str, reason: str):
        super().__init__(f"{where} {reason}" if where.startswith("-") else f"{where}: {reason}")
        self.where = where


class _Unset:
    def __repr__(self) -> str:
        return "unset"


UNSET = _Unset()       # a flag's parsed value when it was not given on the command line


@dataclass(frozen=True)
class Setting:
    path: tuple[str, ...]      # attribute path from the root: ("engine", "cache", "block_size")
    kind: str                  # the field's annotation, as written
    default: object            # MISSING when computed at run time (then `default_text` says what)
    help: str
    flag: str
    choices: tuple | None
    parse: Callable | None
    default_text: str | None
    metavar: str | None
    aliases: tuple[str, ...] = ()      # other flags for it (an old name kept working), YAML keys too

    @property
    def key(self) -> str:
        return self.flag[2:]

    @property
    def keys(self) -> tuple[str, ...]:
        """Its YAML keys (dashed): the flag's, then each alias's."""
        return (self.key, *(a.lstrip("-") for a in self.aliases))

    @property
    def dest(self) -> str:
        return self.key.replace("-", "_")

    @property
    def is_switch(self) -> bool:
        """A --flag / --no-flag pair (an on/off choice with its own parser stays one flag)."""
        return self.kind == "bool" and self.parse is None

    def describe_default(self) -> str:
        if self.default_text is not None:
            return self.default_text
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        if self.default is None:
            return "none"
        return str(self.default)

    def convert(self, raw):
        """The field's value from a command-line string or a YAML value; ValueError says why not."""
        if self.parse is not None:
            return self.parse(raw)
        optional = "None" in self.kind
        if optional and (raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null"))):
            return None
        base = self.kind.replace(" | None", "")
        if base == "bool":
            if isinstance(raw, bool):
                return raw
            raise ValueError(f"expected true or false, got {raw!r}")
        if base == "int":
            if isinstance(raw, bool) or not (isinstance(raw, int) or (isinstance(raw, str) and _is_int(raw))):
                raise ValueError(f"expected an integer{' or none' if optional else ''}, got {raw!r}")
            return int(raw)
        if base == "float":
            try:
                if isinstance(raw, bool):
                    raise ValueError
                return float(raw)
            except (TypeError, ValueError):
                raise ValueError(f"expected a number{' or none' if optional else ''}, got {raw!r}") from None
        if base in ("str", "Path"):
            if isinstance(raw, bool) and self.choices and ("on" if raw else "off") in self.choices:
                raw = "on" if raw else "off"       # YAML reads on/off as booleans
            if not isinstance(raw, str):
                raise ValueError(f"expected a string, got {raw!r}")
            if self.choices and raw not in self.choices:
                raise ValueError(f"must be one of {', '.join(self.choices)}, got {raw!r}")
            return Path(raw) if base == "Path" else raw
        raise TypeError(f"no parser for a {self.kind} setting ({self.flag}); give setting(parse=...)")


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _nested_class(f: dataclasses.Field):
    if f.default_factory is not MISSING and dataclasses.is_dataclass(f.default_factory):
        return f.default_factory
    if f.default is not MISSING and dataclasses.is_dataclass(f.default) and not isinstance(f.default, type):
        return type(f.default)
    return None


def default_flag(name: str) -> str:
    """A field's flag: its name with dashes, seconds' `_s` dropped (--queue-timeout)."""
    return "--" + name.removesuffix("_s").replace("_", "-")


def tree_settings(root: type, prefix: tuple[str, ...] = ()) -> Iterator[Setting]:
    """Every setting under `root`, depth first in declaration order. A field that is neither a
    setting nor derived is a mistake (it could be set by no one): refused here, and by a test."""
    for f in dataclasses.fields(root):
        nested = _nested_class(f)
        if nested is not None:
            yield from tree_settings(nested, (*prefix, f.name))
        elif "help" in f.metadata:
            m = f.metadata
            choices = m["choices"]() if callable(m["choices"]) else m["choices"]
            default = f.default
            if default is MISSING and m["default_text"] is None:
                default = f.default_factory()        # a plain value built fresh (a dict), not computed
            yield Setting((*prefix, f.name), str(f.type), default, m["help"], m["flag"] or default_flag(f.name),
                          tuple(choices) if choices else None, m["parse"], m["default_text"], m["metavar"],
                          m.get("aliases", ()))
        elif "derived" not in f.metadata:
            raise TypeError(f"{root.__name__}.{f.name} is declared with neither setting(...) nor derived(...)")


class _Switch(argparse.Action):
    """--flag turns a setting on, --no-flag off; not given: UNSET (the default stays the field's)."""

    def __init__(self, option_strings, dest, **kwargs):
        flag = option_strings[0]
        super().__init__([flag, "--no-" + flag[2:]], dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, not option_string.startswith("--no-"))

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


class _Store(argparse.Action):
    """A setting's value, and which of its flags gave it (an alias is named back as the user typed it)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        given_as = getattr(namespace, "_given_as", {})
        namespace._given_as = {**given_as, self.dest: option_string}   # noqa: SLF001
        # Every value in order, for the flags that may repeat (--model, --served-model-name: several models).
        repeated = getattr(namespace, "_repeated", {})
        namespace._repeated = {**repeated, self.dest: [*repeated.get(self.dest, []), values]}   # noqa: SLF001


def _argparse_type(s: Setting):
    def parse(text: str):
        try:
            return s.convert(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = s.key     # argparse names a type by it in some messages
    return parse


def add_setting_flags(parser: argparse.ArgumentParser, root: type, titles: dict[str, str]) -> list[Setting]:
    """One flag per setting, grouped by the dataclass that declares it (`titles`: the first
    element of its path -> the group's title; the root's own fields go to the parser itself)."""
    settings = list(tree_settings(root))
    groups: dict[str, argparse._ArgumentGroup] = {}
    for s in settings:
        section = s.path[0] if len(s.path) > 1 else ""
        target = parser
        if section in titles:
            target = groups.get(section) or groups.setdefault(section, parser.add_argument_group(titles[section]))
        text = f"{s.help} (default: {s.describe_default()})".replace("%", "%%")
        if s.is_switch:
            target.add_argument(s.flag, dest=s.dest, action=_Switch, default=UNSET, help=text)
        else:
            metavar = s.metavar or ("{" + ",".join(s.choices) + "}" if s.choices else _metavar(s))
            target.add_argument(s.flag, *s.aliases, dest=s.dest, action=_Store, type=_argparse_type(s),
                                default=UNSET, metavar=metavar, help=text)
    return settings


def _metavar(s: Setting) -> str:
    base = s.kind.replace(" | None", "")
    if s.path[-1].endswith("_s") or "seconds" in s.path[-1]:
        return "SECONDS"
    return {"int": "N", "float": "X", "Path": "DIR"}.get(base, s.key.split("-")[-1].upper())


@dataclass
class Values:
    """A value for each setting given (path -> value), and where each came from."""
    given: dict
    source: dict

    def where(self, s: Setting) -> str:
        return self.source.get(s.path, s.flag)


def from_args(settings: list[Setting], args: argparse.Namespace, yaml_values: Values | None = None) -> Values:
    """The command line over the YAML file's values (which are over the fields' defaults)."""
    values = Values(dict(yaml_values.given), dict(yaml_values.source)) if yaml_values else Values({}, {})
    given_as = getattr(args, "_given_as", {})
    for s in settings:
        value = getattr(args, s.dest, UNSET)
        if value is not UNSET:
            values.given[s.path] = value
            values.source[s.path] = given_as.get(s.dest) or s.flag
    return values


def build(root: type, settings: list[Setting], values: Values, extra: dict | None = None, prefix=()):
    """The tree under `root` from the values given (and `extra`: path -> value of derived fields);
    a field's refusal names the flag or YAML key its value came from."""
    extra = extra or {}
    kwargs = {}
    for f in dataclasses.fields(root):
        path = (*prefix, f.name)
        nested = _nested_class(f)
        if nested is not None:
            kwargs[f.name] = build(nested, settings, values, extra, path)
        elif path in values.given:
            kwargs[f.name] = values.given[path]
        elif path in extra:
            kwargs[f.name] = extra[path]
    try:
        return root(**kwargs)
    except ConfigError as exc:
        by_path = {s.path: s for s in settings}
        s = by_path.get((*prefix, exc.field))
        raise SettingError(values.where(s) if s else exc.field, exc.reason) from None


def settings_markdown(roots: dict[str, type]) -> str:
    """docs/configuration.md's tables: every setting, its flag, YAML key, default and meaning."""
    lines = []
    for title, root in roots.items():
        lines += [f"## {title}", "", "| flag | YAML key | default | field | what it sets |", "|---|---|---|---|---|"]
        for s in tree_settings(root):
            flag = f"`{s.flag}` / `--no-{s.key}`" if s.is_switch else ", ".join(f"`{f}`" for f in (s.flag, *s.aliases))
            choices = f" ({', '.join(s.choices)})" if s.choices else ""
            help_text = s.help.replace("|", "\\|")
            keys = ", ".join(f"`{k.replace('-', '_')}`" for k in s.keys)
            lines.append(f"| {flag} | {keys} | {s.describe_default()} | "
                         f"`{'.'.join(s.path)}` | {help_text}{choices} |")
        lines.append("")
    return "\n".join(lines)


def read_yaml(path: str) -> dict[str, tuple[object, int]]:
    """A YAML file of `key: value` lines: key -> (value, line). Syntax errors name the file and
    line; a top level that is not a mapping is refused by what it is."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SettingError("--config", f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        raise SettingError(where, f"not valid YAML: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise SettingError(path, f"not valid YAML: {exc}") from None
    if node is None:
        return {}
    if not isinstance(node, yaml.MappingNode):
        what = "a list" if isinstance(node, yaml.SequenceNode) else f"a single value ({data!r})"
        raise SettingError(f"{path}:{node.start_mark.line + 1}",
                           f"the top level must be a mapping of setting: value (e.g. `port: 50051`), not {what}")
    lines = {key_node.value: key_node.start_mark.line + 1 for key_node, _ in node.value}
    for key in data:
        if not isinstance(key, str):
            raise SettingError(path, f"a key must be a setting's name, got {key!r}")
    return {key: (value, lines.get(key, 0)) for key, value in data.items()}


def yaml_values(path: str, settings: list[Setting], other_keys: set[str]) -> tuple[Values, dict]:
    """The settings a YAML file gives (converted, each refusal at its line) and its other options
    (`other_keys`, the command's own flags, by dest: set as that parser's defaults)."""
    by_key = {key: s for s in settings for key in s.keys}
    known = sorted({*by_key, *(k.replace("_", "-") for k in other_keys)})
    values, others = Values({}, {}), {}
    for raw_key, (value, line) in read_yaml(path).items():
        key = raw_key.replace("_", "-")
        where = f"{path}:{line}: {raw_key}"
        if key in by_key:
            s = by_key[key]
            if s.path in values.given:
                raise SettingError(where, f"sets what {values.source[s.path].rsplit(': ', 1)[-1]} already set "
                                          f"({' and '.join(s.keys)} are one setting): keep one")
            try:
                values.given[s.path] = s.convert(value)
            except ValueError as exc:
                raise SettingError(where, str(exc)) from None
            values.source[s.path] = where
        elif key.replace("-", "_") in other_keys:
            others[key.replace("-", "_")] = value
        else:
            near = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else " (see `splitserve serve --help`)"
            raise SettingError(f"{path}:{line}", f"unknown option '{raw_key}'{hint}")
    return values, others
