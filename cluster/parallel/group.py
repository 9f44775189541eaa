"""The process group of one tensor-parallel worker: its ranks, the backend chosen from the device
(gloo on CPU, NCCL on CUDA: one code path) and the collectives the sharded layers call.

Every collective runs under the group's deadline (`timeout_s`): a rank that hangs makes the
others' next collective raise instead of waiting forever. The one wait without that deadline is
a follower's wait for rank 0's next step (`wait_for_step`): an idle worker sends none.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# A follower waits for the next step as long as the worker is idle.
IDLE_WAIT = datetime.timedelta(days=365)


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


@dataclass(frozen=True)
class RankGroup:
    """Rank `rank` of `world` ranks on `device`; rank 0 schedules and talks to the router."""
    rank: int
    world: int
    device: torch.device
    timeout_s: float

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums `t` over the ranks, in place (each row-parallel layer's one collective)."""
        dist.all_reduce(t)
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """The ranks' `t` side by side along the last dimension (the vocab-parallel head)."""
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, 0)
        return t

    def all_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values`, in rank order."""
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t)
        return [p.tolist() for p in parts]

    def send(self, t: torch.Tensor, dst: int) -> None:
        """Point to point (the expert balancer moving an expert's weights to the rank that needs them)."""
        dist.send(t.contiguous(), dst)

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        dist.recv(t, src)
        return t

    def wait_for_step(self, t: torch.Tensor) -> torch.Tensor:
        """A follower's receive of rank 0's next broadcast, however long the worker stays idle."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, IDLE_WAIT
        dist.group.WORLD.broadcast([t], opts).wait()
        return t

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def join_group(rank: int, world: int, address: str, device: torch.device, timeout_s: float) -> RankGroup:
    """Joins the group rendezvousing at `address` (tcp://host:port, rank 0's store). On CUDA
    without an index, rank r takes the r-th visible GPU (NCCL wants one rank a GPU)."""
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), init_method=address, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return RankGroup(rank, world, device, timeout_s)
