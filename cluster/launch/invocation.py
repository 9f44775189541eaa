"""What a parsed command line is (`Invocation`), how a command fails (`CommandError`) and how a
stream is printed (`StreamPrinter`): below `cli.py` and the commands it runs
(`remote_commands.py`, `local_commands.py`)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

from cluster.launch.console import Console
from cluster.launch.settings import Values


class CommandError(Exception):
    """A command failed for a reason outside the config (a server's answer): exit status 1."""


@dataclass
class Invocation:
    command: str
    args: argparse.Namespace
    values: Values          # the settings given, on the command line or in YAML
    config: object          # ClusterConfig (serve, chat), EngineConfig (generate); None when nothing runs here
    console: Console = field(default_factory=lambda: Console(None))    # a quiet one for chat, serve --request


class StreamPrinter:
    """The one place a stream is printed: its text as it comes, or one JSON object at its end."""

    def __init__(self, as_json: bool = False, out=None):
        self.as_json, self.out = as_json, out or sys.stdout
        self.ids: list[int] = []
        self.text: list[str] = []
        self.reason: str | None = None

    def add(self, token_ids, text: str, finish_reason: str | None) -> None:
        self.ids.extend(token_ids)
        self.text.append(text)
        if not self.as_json and text:
            self.out.write(text)
            self.out.flush()
        if finish_reason:
            self.reason = finish_reason

    def close(self) -> int:
        if self.as_json:
            print(json.dumps({"token_ids": self.ids, "text": "".join(self.text), "finish_reason": self.reason}),
                  file=self.out)
        else:
            self.out.write("\n")
        return 0
