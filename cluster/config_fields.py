"""The primitives every config dataclass declares its fields with (cluster/config.py): `setting` for
what a user sets (a flag and a YAML key), `derived` for what the wiring fills in, and `require`,
whose refusal is a `ConfigError` naming the field."""
from __future__ import annotations

from dataclasses import MISSING, field


class ConfigError(ValueError):
    """A setting refused: `field` is the dataclass field, `reason` what is wrong ("must be >= 1,
    got 0"). The command line names the flag or YAML key instead of the field."""

    def __init__(self, field_name: str, reason: str):
        super().__init__(f"{field_name} {reason}")
        self.field = field_name
        self.reason = reason


def setting(default=MISSING, help: str = "", *, factory=MISSING, flag: str | None = None, choices=None,  # noqa: A002
            parse=None, default_text: str | None = None, metavar: str | None = None, aliases: tuple[str, ...] = ()):
    """A field a user sets (a flag and a YAML key). `flag` overrides the spelling derived from the
    field's name; `aliases` are other flags for it (each also a YAML key), such as an old name kept
    working; `choices` is a tuple, or a function returning one (a registry imported late); `parse`
    turns text (and YAML's values) into the field's value; `default_text` describes a default
    computed at run time."""
    meta = {"help": help, "flag": flag, "choices": choices, "parse": parse, "default_text": default_text,
            "metavar": metavar, "aliases": tuple(aliases)}
    return field(default=default, default_factory=factory, metadata=meta)


def derived(default=MISSING, why: str = "", *, factory=MISSING, repr: bool = True):  # noqa: A002
    """A field the wiring fills in (from other settings, files or the machine): not a flag."""
    return field(default=default, default_factory=factory, repr=repr, metadata={"derived": why})


def require(ok: bool, field_name: str, reason: str) -> None:
    if not ok:
        raise ConfigError(field_name, reason)


def check_port(field_name: str, port: int | None, optional: bool = False) -> None:
    """A TCP port: 0..65535, 0 picking a free one (None: off, where the port is optional)."""
    if port is None and optional:
        return
    require(isinstance(port, int) and not isinstance(port, bool) and 0 <= port <= 65535, field_name,
            f"must be a port in 0..65535 (0 picks a free one), got {port!r}")
