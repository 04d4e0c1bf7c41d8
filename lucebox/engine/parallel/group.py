"""The tensor-parallel process group: torch.distributed set up for N ranks, and the collectives the sharded
model and the step plans go through.

Two groups over the same ranks: the default one carries the model's collectives (NCCL on CUDA, gloo on the
CPU) under a bounded timeout, and a gloo group carries the step plans, load messages and prefix-cache
snapshots (host data) with no practical timeout, since a follower waits on it for as long as the server is
idle. A collective that fails or
times out is fatal (`fatal`): after a rank is lost the others can only be out of step, so the process says why
and exits instead of answering requests wrongly or hanging.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

TIMEOUT_S = float(os.environ.get("LUCEBOX_TP_TIMEOUT", "120"))  # one model collective, at most
IDLE_TIMEOUT = timedelta(days=365)  # the plan group: followers wait on it while the server is idle
PLAN_WORDS = 1024  # int64 words of a plan sent in the step's one broadcast (a longer plan takes a second)
FATAL_EXIT = 3


def fatal(message: str) -> NoReturn:
    """End this process now, loudly: a lost rank leaves every other rank out of step."""
    log.critical("%s", message)
    print(f"lucebox: tensor parallelism: {message}", file=sys.stderr, flush=True)
    os._exit(FATAL_EXIT)


@dataclass
class Comm:
    """This rank's place in the group and the collectives over it."""

    rank: int
    world: int
    device: torch.device
    plans: Any  # the gloo group of step plans and load messages

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (the partial outputs of a row-parallel layer)."""
        try:
            dist.all_reduce(x)
        except Exception as exc:  # noqa: BLE001 - a peer is gone: nothing is consistent any more
            fatal(f"rank {self.rank}: all-reduce failed ({type(exc).__name__}: {exc})")
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (same shape on each), in rank order."""
        out = [torch.empty_like(x) for _ in range(self.world)]
        try:
            dist.all_gather(out, x.contiguous())
        except Exception as exc:  # noqa: BLE001 - as in all_reduce
            fatal(f"rank {self.rank}: all-gather failed ({type(exc).__name__}: {exc})")
        return out

    def send_plan(self, plan: np.ndarray | None) -> None:
        """Rank 0: broadcast one step's plan (int64 words; None: the engine is closed)."""
        buf = torch.zeros(PLAN_WORDS + 1, dtype=torch.int64)
        n = -1 if plan is None else int(plan.size)
        buf[0] = n
        if 0 < n <= PLAN_WORDS:
            buf[1:n + 1] = torch.from_numpy(plan)
        self._broadcast(buf)
        if n > PLAN_WORDS:
            self._broadcast(torch.from_numpy(np.ascontiguousarray(plan, dtype=np.int64)))

    def recv_plan(self) -> np.ndarray | None:
        """Other ranks: the next plan rank 0 sends (None: the engine is closed)."""
        buf = torch.empty(PLAN_WORDS + 1, dtype=torch.int64)
        self._broadcast(buf)
        n = int(buf[0])
        if n < 0:
            return None
        if n <= PLAN_WORDS:
            return buf[1:n + 1].numpy()
        big = torch.empty(n, dtype=torch.int64)
        self._broadcast(big)
        return big.numpy()

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj`, on every rank (load and exit messages)."""
        box = [obj]
        try:
            dist.broadcast_object_list(box, src=0, group=self.plans)
        except Exception as exc:  # noqa: BLE001 - as in all_reduce
            fatal(f"rank {self.rank}: lost the other ranks ({type(exc).__name__}: {exc})")
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank (each rank's load result)."""
        out: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(out, obj, group=self.plans)
        except Exception as exc:  # noqa: BLE001 - as in all_reduce
            fatal(f"rank {self.rank}: lost the other ranks ({type(exc).__name__}: {exc})")
        return out

    def gather_to_root(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's host tensor x (same shape on each), in rank order, on rank 0 (None on the others):
        a snapshot's K/V heads, over the plan group."""
        out = [torch.empty_like(x) for _ in range(self.world)] if self.rank == 0 else None
        try:
            dist.gather(x.contiguous(), out, dst=0, group=self.plans)
        except Exception as exc:  # noqa: BLE001 - as in all_reduce
            fatal(f"rank {self.rank}: lost the other ranks ({type(exc).__name__}: {exc})")
        return out

    def scatter_from_root(self, out: torch.Tensor, parts: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Rank r's part of rank 0's `parts` (host tensors of out's shape), into `out`: a snapshot's K/V heads."""
        try:
            dist.scatter(out, [p.contiguous() for p in parts] if parts is not None else None, src=0,
                         group=self.plans)
        except Exception as exc:  # noqa: BLE001 - as in all_reduce
            fatal(f"rank {self.rank}: lost the other ranks ({type(exc).__name__}: {exc})")
        return out

    def _broadcast(self, t: torch.Tensor) -> None:
        try:
            dist.broadcast(t, src=0, group=self.plans)
        except Exception as exc:  # noqa: BLE001 - as in all_reduce
            fatal(f"rank {self.rank}: lost the other ranks ({type(exc).__name__}: {exc})")


def init_group(rank: int, world: int, device_type: str, init_method: str = "env://") -> Comm:
    """Join the group as `rank` of `world` (blocks until every rank has joined): NCCL on CUDA (NVLink multicast
    off, as the GPU machines require, set before NCCL starts) with this rank's local GPU, gloo on the CPU."""
    if device_type == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))
    plans = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return Comm(rank, world, device, plans)


def close_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
