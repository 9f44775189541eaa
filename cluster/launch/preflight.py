"""What the command line checks before anything starts (before Ray, before a model loads): what
the config tree cannot know by itself: the machine's devices, the ports free on their hosts, the
files the flags name. Each refusal is a `SettingError` naming the flag."""
from __future__ import annotations

import errno
import socket
from pathlib import Path

from cluster.launch.settings import SettingError


def check_device(device: str) -> None:
    """`--device cuda` needs a torch that sees a CUDA device (torch's own error is an AssertionError)."""
    if not device.startswith("cuda"):
        return
    import torch  # noqa: PLC0415 - torch is heavy: the command line's start-up imports none
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise SettingError("--device", f"is {device!r} but this torch ({torch.__version__}, {build}) sees no CUDA "
                                       "device; give --device cpu, or install a CUDA build of torch")
    index = device.partition(":")[2]
    if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
        raise SettingError("--device", f"is {device!r} but this machine has {torch.cuda.device_count()} CUDA "
                                       f"device(s) (cuda:0 .. cuda:{torch.cuda.device_count() - 1})")


def check_model(model: Path) -> None:
    if not Path(model).exists():
        raise SettingError("--model", f"{model} does not exist (a Hugging Face directory, a .gguf file or a built-in "
                                      "name)")


def check_ports_free(ports: list[tuple[str, str, int | None]]) -> None:
    """Each (flag, host, port) can be bound now (0: a free one is picked, nothing to check), and no
    two flags name one address. A port another server holds is found here, not after Ray started."""
    seen: dict[tuple[str, int], str] = {}
    for flag, host, port in ports:
        if not port:
            continue
        other = seen.setdefault((host, port), flag)
        if other != flag:
            raise SettingError(flag, f"is {port}, the port {other} serves on {host}: give each its own")
        _bind_test(flag, host, port)


def _bind_test(flag: str, host: str, port: int) -> None:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise SettingError("--host" if "metrics" not in flag else "--metrics-host",
                           f"{host!r} is not an address of this machine ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        # SO_REUSEADDR as the servers set it (a port in TIME_WAIT is free), never SO_REUSEPORT:
        # another process's listener must count as taken.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
            raise SettingError(flag, f"{host}:{port} {why}; give another port, or 0 for a free one") from None


def read_file(flag: str, path: str | None, text: bool = False):
    """The contents of a file a flag names (bytes, or stripped text), or None without one."""
    if not path:
        return None
    try:
        return Path(path).read_text() if text else Path(path).read_bytes()
    except OSError as exc:
        raise SettingError(flag, f"cannot read {path}: {exc.strerror or exc}") from None
