"""A worker's step costs, measured (bench/planner_profile.py on this machine) or given for a GPU:
the one cost model the planner's rule, the simulator and `splitserve plan` all read.

A device profile is a JSON object:
  prefill: {"tokens": [...], "seconds": [...]}  one prefill pass of that many new tokens
  decode:  {"batch_sizes": [...], "contexts": [...], "step_s": [[per context] per batch size]}
  kv_bytes_per_token, kv_transfer_bytes_per_s, max_num_seqs, max_num_batched_tokens,
  kv_tokens_per_worker, and optionally worker_start_s, switch_s, name, model, device, memory.
Between measured points costs are interpolated linearly, past the last two extrapolated.
"""
from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

# This machine's measured costs (bench/planner_profile.py), the default where no profile is given.
DEFAULT_PROFILE = Path(__file__).resolve().parent / "cpu-default.json"


def interpolate(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise-linear through (xs, ys), extended by the end segments' slopes."""
    if len(xs) == 1:
        return ys[0] * (x / xs[0] if xs[0] else 1.0)
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class DeviceProfile:
    prefill_tokens: tuple[float, ...]
    prefill_seconds: tuple[float, ...]
    decode_batch_sizes: tuple[float, ...]
    decode_contexts: tuple[float, ...]
    decode_step_s: tuple[tuple[float, ...], ...]     # [batch size][context]
    kv_bytes_per_token: int = 0
    kv_transfer_bytes_per_s: float = 1e9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_tokens_per_worker: int = 1 << 20
    worker_start_s: float = 30.0       # a new worker's start (weights loaded) before it takes work
    switch_s: float = 1.0              # a role switch (no weight reload)
    name: str = "profile"
    model: str = ""
    device: str = ""
    memory: dict = field(default_factory=dict, hash=False, compare=False)

    def prefill_time(self, tokens: float) -> float:
        """Seconds of one prefill pass computing `tokens` new tokens."""
        return interpolate(self.prefill_tokens, self.prefill_seconds, max(tokens, 1.0))

    def prefill_tokens_per_s(self, tokens: float = 512) -> float:
        return tokens / self.prefill_time(tokens)

    def decode_step(self, batch: float, context: float) -> float:
        """Seconds of one decode step of `batch` sequences of mean `context` tokens."""
        batch = max(batch, 1.0)
        per_batch = [interpolate(self.decode_contexts, row, context) for row in self.decode_step_s]
        return interpolate(self.decode_batch_sizes, tuple(per_batch), batch)

    def transfer_time(self, tokens: float) -> float:
        """Seconds to move `tokens` tokens' KV from a prefill worker to a decode worker."""
        return tokens * self.kv_bytes_per_token / self.kv_transfer_bytes_per_s

    def scaled(self, prefill: float = 1.0, decode: float = 1.0) -> DeviceProfile:
        """The same profile with prefill passes `prefill` times and decode steps `decode` times as long
        (costs refitted to measurements: the planner's calibration, the fidelity bench's)."""
        return replace(self, prefill_seconds=tuple(s * prefill for s in self.prefill_seconds),
                       decode_step_s=tuple(tuple(s * decode for s in row) for row in self.decode_step_s))

    def to_json(self) -> str:
        body = asdict(self)
        body["prefill"] = {"tokens": body.pop("prefill_tokens"), "seconds": body.pop("prefill_seconds")}
        body["decode"] = {"batch_sizes": body.pop("decode_batch_sizes"), "contexts": body.pop("decode_contexts"),
                          "step_s": body.pop("decode_step_s")}
        return json.dumps(body, indent=1)


def profile_from_dict(body: dict) -> DeviceProfile:
    body = dict(body)
    prefill, decode = body.pop("prefill"), body.pop("decode")
    step = tuple(tuple(float(v) for v in row) for row in decode["step_s"])
    batches, contexts = tuple(map(float, decode["batch_sizes"])), tuple(map(float, decode["contexts"]))
    if len(step) != len(batches) or any(len(row) != len(contexts) for row in step):
        raise ValueError("device profile: decode.step_s must be [batch_sizes][contexts]")
    if list(batches) != sorted(batches) or list(contexts) != sorted(contexts):
        raise ValueError("device profile: decode batch_sizes and contexts must be increasing")
    known = set(DeviceProfile.__dataclass_fields__)
    return DeviceProfile(tuple(map(float, prefill["tokens"])), tuple(map(float, prefill["seconds"])), batches,
                         contexts, step, **{k: v for k, v in body.items() if k in known})


def load_profile(path: str | Path) -> DeviceProfile:
    try:
        return profile_from_dict(json.loads(Path(path).read_text()))
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a device profile ({exc})") from None
