"""A new user's first chat, as a terminal shows it: `splitserve chat` with the default model in a
pseudo-terminal (stdout and stderr on one screen, as a person sees them). One session, shared by
the assertions: the start, the issue's question, the exit (its follow-up, in docs/first_run.md's
transcript, would double the test's time)."""
import os
import pty
import re
import select
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

QUESTION = "Give me three tips for writing clean Python code."


class Terminal:
    """A command in a pseudo-terminal: what it wrote, read up to a mark."""

    def __init__(self, argv: list[str], env: dict):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:                 # the child: the command, its stdin/stdout/stderr the terminal
            os.execvpe(argv[0], argv, env)
        self.screen = b""

    def read_until(self, mark: bytes, timeout: float) -> bytes:
        start, deadline = len(self.screen), time.monotonic() + timeout
        while mark not in self.screen[start:]:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                shown = self.screen.decode(errors="replace")[-3000:]
                raise AssertionError(f"no {mark!r} within {timeout} s; the screen:\n{shown}")
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:               # the command exited
                chunk = b""
            if not chunk:
                raise AssertionError(f"exited before {mark!r}:\n{self.screen.decode(errors='replace')[-3000:]}")
            self.screen += chunk
        return self.screen[start:]

    def send(self, line: str) -> None:
        os.write(self.fd, line.encode() + b"\n")

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.screen += os.read(self.fd, 65536) if select.select([self.fd], [], [], 0.2)[0] else b""
            except OSError:
                pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
        os.kill(self.pid, 9)
        raise AssertionError("the command did not exit")


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "SPLITSERVE_MODEL"}
    term = Terminal([sys.executable, "-m", "cluster.launch.cli", "chat", "--port", "0", "--http-port", "none",
                     "--transport", "tcp", "--seed", "1"], env)
    start = term.read_until(b"> ", timeout=180).decode(errors="replace")
    term.send(QUESTION)
    first = term.read_until(b"\n> ", timeout=180).decode(errors="replace")
    term.send("/exit")
    code = term.wait(120)
    return {"start": start, "answer": first, "code": code, "screen": term.screen.decode(errors="replace")}


def _answer(echoed: str, question: str) -> str:
    """The answer's text: the terminal echoes the question first, the next prompt ends it."""
    return echoed.replace("\r\n", "\n").split(question, 1)[-1].rsplit("\n> ", 1)[0].strip()


def test_the_start_is_one_status_line_and_then_only_the_conversation(session):
    assert session["code"] == 0, session["screen"][-3000:]
    start = session["start"]
    log = re.search(r"splitserve: logs in (\S+\.log) \(-v shows them here\)", start)
    assert log, start
    assert "\r\x1b[Ksplitserve: " in start and " s" in start        # the status line, repainted with its elapsed time
    assert re.search(r"splitserve: chatting with SmolLM2-135M-Instruct\S*; temperature 0\.2, top-p 0\.9, repetition "
                     r"penalty 1\.15 on the answer's tokens \(SmolLM2-135M-Instruct's model card, our penalty\); seed 1", start), start
    for noise in (" INFO ", " WARNING ", "Started a local Ray instance", "(raylet)"):
        assert noise not in session["screen"], session["screen"]
    kept = Path(log.group(1)).read_text()
    assert "starting Ray" in kept and "INFO" in kept


def test_three_different_tips_not_cut_and_no_sentence_said_three_times(session):
    tips = _answer(session["answer"], QUESTION)
    items = re.findall(r"^\s*(?:\d+[.)]|[-*])\s*(.+)$", tips, flags=re.MULTILINE)
    assert len(items) >= 3 and len(set(items[:3])) == 3, tips
    assert "[cut at" not in session["screen"]
    sentences = [s.strip().lower() for s in re.split(r"(?<=[.!?])\s+|\n+", tips) if len(s.strip()) > 8]
    assert max(sentences.count(s) for s in sentences) < 3, tips
