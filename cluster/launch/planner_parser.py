"""The options of `splitserve simulate` and `splitserve plan` (cluster/planner/, docs/planner.md):
their own, as `generate`'s sampling options are; neither starts a cluster."""
from __future__ import annotations

import argparse
from pathlib import Path

from cluster.planner.costs import DEFAULT_PROFILE
from cluster.planner.traces import TRACES


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def _add_slos(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ttft-slo", type=_positive(float), default=2.0, metavar="SECONDS",
                   help="time-to-first-token target")
    p.add_argument("--itl-slo", type=_positive(float), default=0.1, metavar="SECONDS",
                   help="inter-token latency target (a request's mean gap between tokens)")
    p.add_argument("--input-tokens", type=_positive(int), default=256, help="mean prompt tokens")
    p.add_argument("--output-tokens", type=_positive(int), default=64, help="mean completion tokens")


def add_simulate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", type=Path, default=DEFAULT_PROFILE, metavar="FILE",
                   help="device profile (JSON, bench/planner_profile.py; default: this CPU's, measured)")
    p.add_argument("--trace", choices=tuple(TRACES), default="bursty", help="arrival pattern")
    p.add_argument("--rate", type=_positive(float), required=True, help="mean requests per second")
    p.add_argument("--workers", type=_positive(int), required=True,
                   help="the worker budget (the planner's --max-workers)")
    p.add_argument("--planner", choices=("sla", "fixed", "both"), default="both",
                   help="the SLA planner, a fixed split, or both on the same trace")
    p.add_argument("--prefill", type=_positive(int), default=None,
                   help="the fixed split's (and the planner's first) prefill workers (default: sized for the mean "
                        "load)")
    p.add_argument("--decode", type=_positive(int), default=None, help="... and decode workers (give both or neither; default: sized for the mean load)")
    p.add_argument("--duration", type=_positive(float), default=600.0, metavar="SECONDS", help="trace length")
    p.add_argument("--burst-period", type=_positive(float), default=300.0, metavar="SECONDS",
                   help="the bursty trace's period (its rate swings from 0.1x to 1.9x the mean and back)")
    p.add_argument("--planner-interval", type=_positive(float), default=5.0, metavar="SECONDS",
                   help="how often the planner decides")
    p.add_argument("--seed", type=int, default=0, help="the trace's random seed")
    _add_slos(p)


def add_plan(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="the model (as serve's --model; default: the default model)")
    p.add_argument("--rate", type=_positive(float), required=True, help="requests per second to serve")
    p.add_argument("--device-profile", type=Path, default=DEFAULT_PROFILE, metavar="FILE",
                   help="the workers' step costs and memory (JSON; default: this CPU's, measured)")
    p.add_argument("--max-workers", type=_positive(int), default=10_000, help="the worker budget")
    _add_slos(p)
