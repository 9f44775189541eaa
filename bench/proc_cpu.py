"""CPU time of a server's processes over a timed window, split by role: frontend, engine, other.

    before = snapshot(leader_pid, "vllm" | "splitserve")
    ...                                    # the window: the load runs
    window = between(before, snapshot(leader_pid, kind), wall_s)    # a ServerCpu

The server is a process started in a session of its own (bench/servers.py), its leader: `vllm
serve` (bench/vllm_shim.py) or `splitserve serve`. Its processes are the members of that session,
the leader's descendants and, for splitserve, any process whose command line names the leader's
Ray session directory (`session_<date>_<leader pid>`): on a local cluster Ray's processes and
actors are all descendants of the driver (raylet starts the workers), and the last two catch any
that would not be.

Roles, what "frontend CPU per token" compares:
  vllm        frontend: the leader, the API server (HTTP, tokenizing, detokenizing, streaming), and
              any VLLM::APIServer_N; engine: VLLM::EngineCore and what runs under it (on CPU its
              VLLM::Worker, the model runner), or an untitled multiprocessing child; other: the
              rest (multiprocessing's resource tracker, ...)
  splitserve  frontend: the leader, the driver (the router and, with the default --frontends 1,
              the frontend) and any ray::Frontend actor; engine: the ray::PrefillWorker and
              ray::DecodeWorker actors; other: Ray's own processes (gcs_server, raylet, agents,
              monitors, dashboard, idle workers)

A process below an engine process is "engine" too. CPU is utime + stime of /proc/<pid>/stat (every
thread of the process; not its reaped children), read by bench/idle_cpu.py's `cpu_ticks`. A process
born in the window counts all its time; one that exits in the window loses its time in it (counted
in `exited`). Linux only; stdlib only.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))   # idle_cpu, when imported from elsewhere
from idle_cpu import CLK_TCK, cmdline, cpu_ticks, descendants, proc_name, stat_fields  # noqa: E402

ROLES = ("frontend", "engine", "other")
KINDS = ("vllm", "splitserve")
_WORKER_ACTORS = ("ray::PrefillWorker", "ray::DecodeWorker")


@dataclass(frozen=True)
class ProcCpu:
    """One process at one instant."""
    pid: int
    started: str       # starttime in /proc/<pid>/stat: tells a reused pid apart
    name: str
    role: str
    ticks: int


@dataclass(frozen=True)
class ServerCpu:
    """CPU seconds of a server's processes over a window, by role and by process."""
    wall_s: float
    seconds: dict       # role -> CPU seconds
    processes: tuple    # ({"pid", "name", "role", "cpu_s"}, ...), busiest first
    exited: int         # processes gone before the window's end (their time in it is lost)

    def to_json(self) -> dict:
        return {"wall_s": self.wall_s, "cpu_s": self.seconds, "processes": list(self.processes),
                "exited": self.exited}


def session_members(sid: int) -> set[int]:
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            f = stat_fields(f"/proc/{entry}/stat")
            if f and int(f[3]) == sid:      # after "(comm)": state, ppid, pgrp, session
                out.add(int(entry))
    return out


def ray_session_members(leader: int) -> set[int]:
    """Processes naming the Ray session that `leader` started (its directory ends in _<pid>)."""
    mark = re.compile(rf"session_[0-9_-]+_{leader}\b")
    return {int(e) for e in os.listdir("/proc") if e.isdigit() and mark.search(cmdline(int(e)))}


def server_pids(leader: int, kind: str) -> set[int]:
    pids = session_members(leader) | set(descendants(leader))
    return pids | ray_session_members(leader) if kind == "splitserve" else pids


def role_of(pid: int, leader: int, kind: str) -> tuple[str, str]:
    """(name, role) of one of a server's processes."""
    if pid == leader:
        return ("api server (vllm serve)" if kind == "vllm" else "driver (serve: router + frontend)"), "frontend"
    if kind == "splitserve":
        name = proc_name(pid, leader)          # ray::DecodeWorker, raylet, gcs_server, ...
        if name in _WORKER_ACTORS:
            return name, "engine"
        return name, "frontend" if name == "ray::Frontend" else "other"
    title = cmdline(pid)
    name = title.split()[0] if title.startswith("VLLM::") else \
        "resource_tracker" if "resource_tracker" in title else proc_name(pid, leader)
    if "APIServer" in title:
        return name, "frontend"
    if "EngineCore" in title or title.startswith("VLLM::Worker") or "spawn_main" in title:
        return name, "engine"
    return name, "other"


def inherit_engine(roles: dict[int, str], parents: dict[int, int]) -> dict[int, str]:
    """A process started by an engine process works for it (vLLM's VLLM::Worker under
    VLLM::EngineCore, a compiler torch.compile runs): "other" below an engine becomes "engine"."""
    out = dict(roles)
    for pid, role in roles.items():
        up, seen = parents.get(pid), set()
        while role == "other" and up in roles and up not in seen:
            seen.add(up)
            if roles[up] == "engine":
                out[pid] = "engine"
                break
            up = parents.get(up)
    return out


def snapshot(leader: int, kind: str) -> dict[tuple[int, str], ProcCpu]:
    """Every process of the server now, keyed by (pid, start time)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    started, ticks, names, roles, parents = {}, {}, {}, {}, {}
    for pid in server_pids(leader, kind):
        f, t = stat_fields(f"/proc/{pid}/stat"), cpu_ticks(f"/proc/{pid}/stat")
        if f is None or t is None:
            continue                           # gone meanwhile
        started[pid], ticks[pid], parents[pid] = f[19], t, int(f[1])
        names[pid], roles[pid] = role_of(pid, leader, kind)
    roles = inherit_engine(roles, parents)
    return {(pid, started[pid]): ProcCpu(pid, started[pid], names[pid], roles[pid], ticks[pid]) for pid in ticks}


def between(before: dict, after: dict, wall_s: float) -> ServerCpu:
    """What each role spent from `before` to `after` (two snapshots of the same server)."""
    seconds = dict.fromkeys(ROLES, 0.0)
    rows = []
    for key, p in after.items():
        start = before[key].ticks if key in before else 0   # born in the window: all its time counts
        cpu_s = (p.ticks - start) / CLK_TCK
        seconds[p.role] += cpu_s
        rows.append({"pid": p.pid, "name": p.name, "role": p.role, "cpu_s": round(cpu_s, 3)})
    rows.sort(key=lambda r: -r["cpu_s"])
    exited = sum(1 for key in before if key not in after)
    return ServerCpu(round(wall_s, 3), {r: round(s, 3) for r, s in seconds.items()}, tuple(rows), exited)
