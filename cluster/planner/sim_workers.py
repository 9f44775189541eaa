"""The simulator's workers: a discrete-event model of one engine's steps, from a `DeviceProfile`.

A prefill worker takes queued prompts first come first served, as many as one pass's token budget
holds (at least one), and its pass takes `prefill_time(tokens)`; the prompt's first token comes
with it. A decode worker steps its whole batch at once (`decode_step(batch, mean context)`), takes
waiting sequences into the batch at a step's start while the batch limit and its KV allow, and a
sequence leaves when its last token is out. A colocated worker mixes both in one step: the batch's
decode tokens plus chunks of the queued prompts, oldest first, while the step's token budget
lasts (as the engine's scheduler admits them), the longer of the two costs. Blocks a worker has
prefilled stay cached (LRU, its KV's size), so a prompt sharing them computes only the rest.
"""
from __future__ import annotations

import enum
import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass

from cluster.planner.costs import DeviceProfile
from cluster.planner.traces import BLOCK_TOKENS, TraceRequest


class WorkerState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"      # leaving or switching: takes nothing new
    GONE = "gone"


@dataclass(eq=False)
class SimRequest:
    id: int
    trace: TraceRequest
    arrival_s: float
    prefilled: int = 0               # prompt tokens computed so far (colocated chunks)
    compute_tokens: int = 0          # prompt tokens to compute (the rest were cached)
    first_token_s: float | None = None
    done_s: float | None = None
    remaining: int = 0               # decode tokens still to come
    prefill_start_s: float | None = None

    @property
    def context(self) -> int:
        return self.trace.input_tokens + self.trace.output_tokens - self.remaining


class SimWorker:
    def __init__(self, name: str, role: str, costs: DeviceProfile, state: WorkerState = WorkerState.SERVING):
        self.name, self.role, self.costs, self.state = name, role, costs, state
        self.queue: deque[SimRequest] = deque()        # prompts to prefill
        self.waiting: deque[SimRequest] = deque()      # sequences waiting for the batch
        self.running: list[tuple[int, int, SimRequest]] = []   # (finish step, id, request)
        self.steps = 0
        self.context_sum = 0
        self.busy = False
        self.batch: list[SimRequest] = []
        self.chunk = 0                                  # prompt tokens the step computes
        self.chunks: list[tuple[SimRequest, int]] = []  # a colocated step's (prompt, tokens)
        self.cache: OrderedDict[bytes, None] = OrderedDict()
        self.cache_blocks = max(1, costs.kv_tokens_per_worker // BLOCK_TOKENS)
        self.measured_busy_s = 0.0
        self.measured_prefill_tokens = 0
        self.measured_steps = 0

    # -- what the router sees
    def load(self) -> int:
        return len(self.queue) + len(self.batch) + len(self.waiting)

    def kv_free_share(self) -> float:
        return max(0.0, 1 - self.context_sum / self.costs.kv_tokens_per_worker)

    # -- taking work
    def take_prompt(self, req: SimRequest) -> None:
        cached = 0
        for key in req.trace.blocks:
            if key not in self.cache:
                break
            self.cache.move_to_end(key)
            cached += 1
        req.compute_tokens = max(1, req.trace.input_tokens - cached * BLOCK_TOKENS)
        self.queue.append(req)

    def take_sequence(self, req: SimRequest) -> None:
        self.waiting.append(req)

    def _remember(self, req: SimRequest) -> None:
        for key in req.trace.blocks:
            self.cache[key] = None
            self.cache.move_to_end(key)
        while len(self.cache) > self.cache_blocks:
            self.cache.popitem(last=False)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.costs.max_num_seqs:
            req = self.waiting[0]
            need = req.trace.input_tokens + req.trace.output_tokens
            if self.running and self.context_sum + need > self.costs.kv_tokens_per_worker:
                return
            self.waiting.popleft()
            self._join(req)

    def _join(self, req: SimRequest) -> None:
        self.context_sum += req.context
        heapq.heappush(self.running, (self.steps + max(req.remaining, 0), req.id, req))

    # -- one step
    def start_step(self) -> float | None:
        """Plan the next step; its duration, or None when there is nothing to do."""
        if self.role == "prefill":
            return self._start_prefill()
        self._admit()
        self.chunks = self._plan_chunks() if self.role == "both" else []
        chunk = sum(n for _, n in self.chunks)
        b = len(self.running)
        if not b and not chunk:
            return None
        mean_ctx = self.context_sum / b if b else 0
        cost = self.costs.decode_step(b, mean_ctx) if b else 0.0
        if chunk:
            cost = max(cost, self.costs.prefill_time(chunk + b))
        self.chunk = chunk
        self.busy = True
        return cost

    def _start_prefill(self) -> float | None:
        if not self.queue:
            return None
        budget, self.batch = self.costs.max_num_batched_tokens, []
        tokens = 0
        while self.queue and (not self.batch or tokens + self.queue[0].compute_tokens <= budget):
            req = self.queue.popleft()
            tokens += req.compute_tokens
            self.batch.append(req)
        self.chunk = tokens
        self.busy = True
        return self.costs.prefill_time(tokens)

    def _plan_chunks(self) -> list[tuple[SimRequest, int]]:
        """The queued prompts' chunks of a colocated step, oldest first, within the token budget
        the decodes leave and the batch limit."""
        room = self.costs.max_num_batched_tokens - len(self.running)
        chunks: list[tuple[SimRequest, int]] = []
        for req in self.queue:
            if room <= 0 or len(self.running) + len(chunks) >= self.costs.max_num_seqs:
                break
            n = max(1, min(room, req.compute_tokens - req.prefilled))
            chunks.append((req, n))
            room -= n
        return chunks

    def finish_step(self, now: float, duration: float) -> tuple[list[SimRequest], list[SimRequest]]:
        """Account the step that just ended: (prompts whose first token came out, sequences done)."""
        self.busy = False
        self.measured_busy_s += duration
        if self.role == "prefill":
            out, self.batch = self.batch, []
            self.measured_prefill_tokens += self.chunk
            for req in out:
                req.first_token_s = now
                req.remaining = req.trace.output_tokens - 1
                self._remember(req)
            return out, []
        first = self._finish_chunks(now) if self.chunks else []
        done = self._advance_batch(now)
        return first, done

    def _finish_chunks(self, now: float) -> list[SimRequest]:
        first = []
        for req, n in self.chunks:
            req.prefilled += n
            self.measured_prefill_tokens += n
            if req.prefilled < req.compute_tokens:
                continue
            self.queue.remove(req)
            req.first_token_s = now
            req.remaining = req.trace.output_tokens - 1
            self._remember(req)
            self._join(req)
            first.append(req)
        self.chunks = []
        return first

    def _advance_batch(self, now: float) -> list[SimRequest]:
        if not self.running:
            return []
        self.steps += 1
        self.measured_steps += 1
        done = []
        self.context_sum += len(self.running)
        while self.running and self.running[0][0] <= self.steps:
            _, _, req = heapq.heappop(self.running)
            req.remaining = 0
            req.done_s = now
            self.context_sum -= req.context
            done.append(req)
        return done

    def evict_all(self) -> list[SimRequest]:
        """A leaving worker's sequences and prompts, to move to peers (the lossless drain)."""
        moved = []
        for finish, _, req in self.running:
            req.remaining = max(finish - self.steps, 0)
            moved.append(req)
        moved += list(self.waiting) + list(self.queue)
        self.running, self.waiting, self.queue = [], deque(), deque()
        self.context_sum = 0
        return moved
