"""The ranks of a tensor-parallel engine: rank 0 is the engine's process, ranks 1.. are spawned
workers.

torch.distributed does the talking (gloo on CPU, NCCL on CUDA for the
all-reduces); torch.multiprocessing starts the workers. Rank 0 broadcasts each step's block
moves and each forward's inputs; a worker applies the moves and runs its shard of
the forward, and the two all-reduces per layer keep every rank's hidden states
equal. A worker that dies makes rank 0's next collective fail: the error names
the rank and its exit code, and the engine stops (the server exits non-zero).
"""

from __future__ import annotations

import copy
import datetime
import logging
import os
import tempfile
import threading
import time
import weakref
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from pagedkv.config import ConfigError, EngineConfig

if TYPE_CHECKING:
    from pagedkv.distributed.tiers import HostOp

log = logging.getLogger("pagedkv")
STOP_TIMEOUT_S = 30  # a worker's disk tier may still be writing what was queued (at most 25 s)
TIMEOUT = datetime.timedelta(
    minutes=10
)  # one collective may wait out a long prefill on a slow rank


class TensorParallelError(RuntimeError):
    """A rank is gone: the engine cannot run another step (fatal, not one request's fault)."""

    fatal = True


def all_reduce(t: Tensor) -> None:
    """Sum over ranks in place, in float32 (gloo sums bf16 poorly, and float32 matches one rank's
    matmul)."""
    if t.dtype == torch.float32:
        dist.all_reduce(t)
        return
    wide = t.float()
    dist.all_reduce(wide)
    t.copy_(wide)


def min_over_ranks(n: int, poll_s: float | None = None) -> int:
    """The smallest of every rank's value (the KV pool is sized by the rank with the least
    memory). With `poll_s`, waits in Python, looking that often, so that a SIGTERM's handler runs
    at once: at load the ranks meet here only when the slowest has loaded its shard (10+ s)."""
    t = torch.tensor([n], dtype=torch.int64)
    if poll_s is None:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    else:
        work = dist.all_reduce(t, op=dist.ReduceOp.MIN, async_op=True)
        assert work is not None  # (async_op)
        while not work.is_completed():
            time.sleep(poll_s)
        work.wait()  # raises what failed it
    return int(t.item())


def backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class TensorParallelGroup:
    """Rank 0's handle on the workers: starts them, sends each step's moves and inputs, stops
    them."""

    def __init__(self, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.world = config.tensor_parallel_size
        self.host_ops: list[HostOp] = []  # host tier slot changes the ranks have not seen yet
        if dist.is_initialized():
            raise ConfigError("one tensor-parallel engine per process: close the other first")
        self._dir = tempfile.TemporaryDirectory(prefix="pagedkv-tp-")
        init = f"file://{os.path.join(self._dir.name, 'rendezvous')}"
        ctx = mp.get_context("spawn")
        worker_config = copy.copy(
            config
        )  # not dataclasses.replace: parsing sizes again would rescale them
        worker_config.dtype = str(dtype).removeprefix("torch.")
        self.procs = [
            ctx.Process(
                target=_worker_main,
                name=f"pagedkv-tp-rank{r}",
                daemon=True,
                args=(r, self.world, init, worker_config, os.getpid()),
            )
            for r in range(1, self.world)
        ]
        for p in self.procs:
            p.start()
        dist.init_process_group(
            backend(device), init_method=init, rank=0, world_size=self.world, timeout=TIMEOUT
        )
        self.closed = False
        self._served = threading.Event()  # a step was sent: the workers may have work to save
        self._finalizer = weakref.finalize(self, _stop, self.procs, self._served)
        threading.Thread(target=self._watch, name="pagedkv-tp-watch", daemon=True).start()

    def dead_rank(self) -> tuple[int, int | None] | None:
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                return rank, p.exitcode
        return None

    def _watch(self) -> None:
        """Says which rank died as soon as it does, even while rank 0 is idle."""
        while not self.closed and self._finalizer.alive:  # (not stopping at exit)
            dead = self.dead_rank()
            if dead is not None and not self.closed and self._finalizer.alive:
                log.error(
                    "tensor-parallel rank %d exited (code %s): the engine cannot go on", *dead
                )
                return
            threading.Event().wait(0.5)

    def send(self, item: object) -> None:
        """Broadcast block moves, forward inputs or tier work, after the host tier's
        slot changes since the last one. TensorParallelError when a rank is gone."""
        self._served.set()
        try:
            dist.broadcast_object_list([(self.host_ops, item)], src=0)
        except RuntimeError as e:
            raise self.error(e) from e
        self.host_ops.clear()

    def min_over_ranks(self, n: int) -> int:
        try:
            return min_over_ranks(n)
        except RuntimeError as e:
            raise self.error(e) from e

    def error(self, cause: BaseException) -> TensorParallelError:
        dead = self.dead_rank()
        what = (
            f"rank {dead[0]} exited with code {dead[1]}"
            if dead
            else f"{type(cause).__name__}: {cause}"
        )
        return TensorParallelError(f"tensor parallelism failed: {what}")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._finalizer()
        self._dir.cleanup()


def _stop(procs: list, served: threading.Event) -> None:
    """Stop the workers (on close, or at exit for an engine never closed): tell them, so each
    writes what its disk tier has queued and leaves; wait; kill one that hangs. Workers that
    never got a step (rank 0 stopped while they load: SIGTERM, a ConfigError) have nothing to
    save and would hear nothing until their own load ends: killed at once."""
    if not served.is_set():
        for p in procs:
            p.kill()
    elif dist.is_initialized() and all(p.is_alive() for p in procs):
        try:
            dist.broadcast_object_list([([], None)], src=0)
        except RuntimeError:
            pass
    for p in procs:
        p.join(timeout=STOP_TIMEOUT_S)
        if p.is_alive():
            p.kill()
            p.join()
    if dist.is_initialized():
        dist.destroy_process_group()


def _leave_with(parent: int) -> None:
    """Exit once rank 0 is gone: killed (kill -9, the OOM killer) as the ranks meet, it leaves a
    worker waiting out TIMEOUT in init_process_group, an orphan for ten minutes."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _worker_main(rank: int, world: int, init: str, config: EngineConfig, parent: int) -> None:
    """A worker rank: build its shard and its KV storage as rank 0 does, then run what rank 0 sends
    until None. `parent` is rank 0's pid."""
    threading.Thread(
        target=_leave_with, args=(parent,), name="pagedkv-tp-parent", daemon=True
    ).start()
    # late: the spawned child imports torch first
    from pagedkv.distributed.tiers import TierReserve, replay
    from pagedkv.engine.setup import build_worker_runner

    torch.set_num_threads(
        max(1, int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads())
    )
    device = torch.device("cpu")
    dist.init_process_group(
        backend(device), init_method=init, rank=rank, world_size=world, timeout=TIMEOUT
    )
    runner = build_worker_runner(config, rank, device)
    while True:
        box: list = [None]
        try:
            dist.broadcast_object_list(box, src=0)
        except RuntimeError:  # rank 0 is gone: nothing left to serve
            break
        host_ops, item = box[0]
        if host_ops:
            replay(runner.offload, host_ops)
        if item is None:
            break
        if isinstance(item, TierReserve):
            item.apply(runner.offload)
        else:
            runner.run(item)
    if runner.offload is not None:
        runner.offload.close()  # what is queued for this rank's disk gets there
    dist.destroy_process_group()
