"""The follower ranks of a tensor-parallel engine started by rank 0 itself, as processes of this
machine (`generate --tensor-parallel-size N`, in-process engines, tests): rank 0 is the calling
process; its group's store listens on 127.0.0.1."""
from __future__ import annotations

import dataclasses
import multiprocessing
import socket

import torch

from cluster.config import EngineConfig
from cluster.parallel.follower import follower_main
from cluster.parallel.group import RankGroup, join_group
from cluster.parallel.step_message import StepSender, stop_message

# How long close() waits for a follower to leave after its stop message.
JOIN_TIMEOUT_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRanks:
    """Ranks 1..N-1 as spawned processes, and rank 0's group with them."""

    def __init__(self, config: EngineConfig):
        address = f"tcp://127.0.0.1:{_free_port()}"
        ctx = multiprocessing.get_context("spawn")   # a fork would copy rank 0's threads and torch state
        self.processes = [ctx.Process(target=follower_main, args=(dataclasses.replace(config, tp_rank=r), address),
                                      name=f"tp-rank-{r}", daemon=True)
                          for r in range(1, config.tensor_parallel_size)]
        for p in self.processes:
            p.start()
        self.group: RankGroup = join_group(0, config.tensor_parallel_size, address, torch.device(config.device),
                                           config.tp_collective_timeout_s)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def kill(self) -> None:
        """Ends the followers at once (the group is broken: nothing to tell them)."""
        for p in self.processes:
            if p.is_alive():
                p.kill()
            p.join()

    def close(self) -> None:
        """Stops the followers (a stop message; killed if they do not leave) and leaves the group."""
        try:
            if self.alive():
                StepSender(self.group).send(stop_message(self.group.device))
        except RuntimeError:   # a follower already gone: the group is broken, nothing to tell
            pass
        for p in self.processes:
            p.join(JOIN_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join()
        self.group.close()
