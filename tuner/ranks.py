"""The ranks of a torch.distributed job, as tuner uses them: split work, meet at tuning
boundaries, agree on one answer. Collectives move integers only (no pickled objects)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Ranks:
    rank: int
    world: int
    group: Any = None  # None: the default group

    def _device(self) -> torch.device:
        import torch.distributed as dist

        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def barrier(self) -> None:
        """A tuning boundary: every rank arrives before any goes on (an all-reduce, which
        returns only when every rank has reached it)."""
        self.any(False)

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on some rank."""
        import torch.distributed as dist

        t = torch.tensor([int(flag)], dtype=torch.int64, device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def broadcast(self, value: int, src: int = 0) -> int:
        """src's integer, on every rank."""
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=self._device())
        dist.broadcast(t, src=src, group=self.group)
        return int(t.item())

    def mine(self, index: int) -> bool:
        """Whether work item `index` is this rank's (round robin)."""
        return index % self.world == self.rank


def current_ranks() -> Ranks | None:
    """The initialised default process group, if it has more than one rank; else None."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return Ranks(dist.get_rank(), dist.get_world_size())


def _env_int(name: str, minimum: int, maximum: int | None = None) -> int:
    from tuner.errors import TunerError

    raw = os.environ.get(name)
    if raw is None:
        raise TunerError(f"WORLD_SIZE is set but {name} is not: start several ranks with torchrun, "
                         "which sets WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT")
    try:
        value = int(raw)
    except ValueError:
        raise TunerError(f"{name} must be an integer, got {raw!r:.40}") from None
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise TunerError(f"{name} must be {bound}, got {value}")
    return value


def ranks_from_launcher() -> Ranks | None:
    """Under torchrun (WORLD_SIZE > 1 in the environment): the default process group,
    initialised here if the caller has not (NCCL when this rank has a GPU, else gloo).
    A launcher environment that cannot start one (WORLD_SIZE not an integer, RANK or the
    rendezvous address missing) is a TunerError naming the variable."""
    from tuner.errors import TunerError

    if "WORLD_SIZE" not in os.environ:
        return None
    world = _env_int("WORLD_SIZE", 1)
    if world < 2:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        import atexit

        rank = _env_int("RANK", 0, world - 1)
        local = _env_int("LOCAL_RANK", 0) if "LOCAL_RANK" in os.environ else rank
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(name):
                raise TunerError(f"WORLD_SIZE={world} but {name} is not set: start several ranks with torchrun")
        _env_int("MASTER_PORT", 1, 65535)
        if torch.cuda.is_available():
            torch.cuda.set_device(local % torch.cuda.device_count())
        try:
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        except (RuntimeError, ValueError) as e:
            text = str(e).strip().splitlines()
            raise TunerError(f"cannot start the process group of rank {rank}/{world}: "
                             f"{text[0] if text else type(e).__name__}") from None
        atexit.register(dist.destroy_process_group)
    return current_ranks()
