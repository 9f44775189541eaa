"""Promoted heads on disk (`--spec-online-dir`), and what a restarted trainer resumes from them.

DIR/TENANT/vN/ holds `trainable.safetensors` (the version's trainable tensors), the target's
weight fingerprint, the base head's name and the version's `state`: promoted (on probation), kept
(it held up over its window) or rolled_back. A restarted trainer resumes, per tenant, the newest
kept version for the same target weights and base head; a version on probation when the trainer
died was never judged, so it is not resumed. Nothing is written without a directory.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from decode.spec.online.messages import pack_tensors, unpack_tensors

ANONYMOUS = "_anonymous"   # the folder of requests without an API key's tenant
STATES = ("promoted", "kept", "rolled_back")


@dataclass(frozen=True)
class Resumed:
    tenant: str
    version: int | None                    # None: no kept version, the base head
    tensors: dict[str, torch.Tensor] | None
    next_version: int                      # past every saved version: numbers are never reused


class HeadStore:
    def __init__(self, root: Path | None, fingerprint: str, base_head: str):
        self.root = None if root is None else Path(root)
        self.fingerprint, self.base_head = fingerprint, base_head

    def _folder(self, tenant: str, version: int) -> Path | None:
        return None if self.root is None else self.root / (tenant or ANONYMOUS) / f"v{version}"

    def save(self, tenant: str, version: int, tensors: dict[str, torch.Tensor]) -> None:
        folder = self._folder(tenant, version)
        if folder is None:
            return
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "trainable.safetensors").write_bytes(pack_tensors(tensors))
        (folder / "target_fingerprint").write_text(self.fingerprint)
        (folder / "base_head").write_text(self.base_head)
        self.mark(tenant, version, "promoted")

    def mark(self, tenant: str, version: int, state: str) -> None:
        if state not in STATES:
            raise ValueError(f"a saved head's state is one of {', '.join(STATES)}, not {state!r}")
        folder = self._folder(tenant, version)
        if folder is not None and folder.is_dir():
            (folder / "state").write_text(state)

    def resume(self, names: tuple[str, ...], wanted: Callable[[str], bool]) -> list[Resumed]:
        """Per saved tenant that `wanted` accepts: its newest kept version for these weights and
        this base head (tensors checked by name), and the next free version number."""
        if self.root is None or not self.root.is_dir():
            return []
        out = []
        for tenant_dir in sorted(p for p in self.root.iterdir() if p.is_dir()):
            tenant = "" if tenant_dir.name == ANONYMOUS else tenant_dir.name
            if not wanted(tenant):
                continue
            saved = sorted((int(v.name[1:]), v) for v in tenant_dir.glob("v*") if v.name[1:].isdigit())
            next_version = max((n + 1 for n, _ in saved), default=1)
            kept = [(n, v) for n, v in saved if self._resumable(v)]
            if not kept:
                out.append(Resumed(tenant, None, None, next_version))
                continue
            version, folder = kept[-1]
            tensors = unpack_tensors((folder / "trainable.safetensors").read_bytes(), names)
            out.append(Resumed(tenant, version, tensors, next_version))
        return out

    def _resumable(self, folder: Path) -> bool:
        def text(name: str) -> str | None:
            f = folder / name
            return f.read_text() if f.is_file() else None
        return (text("state") == "kept" and text("target_fingerprint") == self.fingerprint
                and text("base_head") == self.base_head and (folder / "trainable.safetensors").is_file())
