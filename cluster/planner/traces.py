"""Request traces for the simulator: Poisson, a bursty sinusoid, and a Mooncake-style agent trace
(sessions whose turns share a long system prefix and their own growing history).

A request's prompt is described by its block keys (the router's policy scores prefixes by them):
blocks shared between requests have the same key, as the workers' chained hashes would.
"""
from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass

BLOCK_TOKENS = 16


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[bytes, ...] = ()     # the prompt's full blocks' keys


@dataclass(frozen=True)
class Shape:
    input_tokens: int = 256
    output_tokens: int = 64
    spread: float = 0.5                # lengths uniform within +- this share of the mean


def _key(*parts) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()


def _private_blocks(tag, tokens: int) -> tuple[bytes, ...]:
    return tuple(_key(tag, i) for i in range(tokens // BLOCK_TOKENS))


def _lengths(rng: random.Random, shape: Shape) -> tuple[int, int]:
    def draw(mean):
        return max(1, round(mean * (1 + shape.spread * (2 * rng.random() - 1))))
    return draw(shape.input_tokens), draw(shape.output_tokens)


def arrivals(rate_at, peak: float, duration_s: float, rng: random.Random) -> list[float]:
    """A Poisson process of rate `rate_at(t)` (at most `peak`), by thinning."""
    t, out = 0.0, []
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            return out
        if rng.random() * peak < rate_at(t):
            out.append(t)


def poisson(rate: float, duration_s: float, shape: Shape = Shape(), seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(seed)
    return _independent(arrivals(lambda t: rate, rate, duration_s, rng), shape, rng)


def bursty(rate: float, duration_s: float, shape: Shape = Shape(), seed: int = 0, amplitude: float = 0.9,
           period_s: float = 300.0) -> list[TraceRequest]:
    """Mean `rate`, swinging sinusoidally between (1 - amplitude) and (1 + amplitude) times it
    (amplitude 0.9: 0.1x to 1.9x, Dynamo #10528's 1-24 req/s around a mean of 12.5)."""
    rng = random.Random(seed)
    def rate_at(t):
        return rate * (1 + amplitude * math.sin(2 * math.pi * t / period_s))
    return _independent(arrivals(rate_at, rate * (1 + amplitude), duration_s, rng), shape, rng)


def _independent(times: list[float], shape: Shape, rng: random.Random) -> list[TraceRequest]:
    out = []
    for i, t in enumerate(times):
        n_in, n_out = _lengths(rng, shape)
        out.append(TraceRequest(t, n_in, n_out, _private_blocks(("req", i), n_in)))
    return out


def agent(rate: float, duration_s: float, shape: Shape = Shape(), seed: int = 0, prefixes: int = 8,
          prefix_tokens: int = 1024, turns: int = 6) -> list[TraceRequest]:
    """Sessions start at `rate / turns` per second; each sends `turns` requests a few seconds
    apart, each prompt = one of `prefixes` shared system prompts + the session's history so far +
    a new message (Mooncake's traces: long, mostly cached prompts, short answers)."""
    rng = random.Random(seed)
    out = []
    for s, start in enumerate(arrivals(lambda t: rate / turns, rate / turns, duration_s, rng)):
        prefix = _private_blocks(("prefix", rng.randrange(prefixes)), prefix_tokens)
        history, t = (), start
        for turn in range(turns):
            n_in, n_out = _lengths(rng, shape)
            history += _private_blocks(("session", s, turn), n_in + n_out)
            blocks = prefix + history
            out.append(TraceRequest(t, len(blocks) * BLOCK_TOKENS, n_out, blocks))
            t += rng.expovariate(1 / 3.0)
    return sorted((r for r in out if r.arrival_s < duration_s), key=lambda r: r.arrival_s)


TRACES = {"poisson": poisson, "bursty": bursty, "agent": agent}


def make_trace(name: str, rate: float, duration_s: float, shape: Shape = Shape(), seed: int = 0,
               period_s: float = 300.0) -> list[TraceRequest]:
    """`period_s`: the bursty trace's period (the others ignore it)."""
    if name not in TRACES:
        raise ValueError(f"unknown trace {name!r}; choose one of {', '.join(TRACES)}")
    if name == "bursty":
        return bursty(rate, duration_s, shape, seed, period_s=period_s)
    return TRACES[name](rate, duration_s, shape, seed)
