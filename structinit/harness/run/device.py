"""Where a run computes, and the record of it: the process group of a distributed run, the
device, the autocast dtype that ``precision`` resolves to, and the versions and hardware a
result records so that a number can be traced to the machine that made it."""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import structinit

__all__ = ["Placement", "describe_device", "placement", "resolve_precision", "versions"]

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # the autocast dtype of each (None: off)
CPUINFO = Path("/proc/cpuinfo")  # what the kernel says of the CPU: its model name and feature flags


@dataclass(frozen=True)
class Placement:
    """This process's share of a run: ``world`` processes, this one ``rank`` on ``device``."""

    world: int
    rank: int
    device: torch.device

    @property
    def writes(self) -> bool:
        """Whether this process writes the run's files (rank 0 only)."""
        return self.rank == 0

    def all_reduce(self, totals: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(totals)
        return totals


def placement() -> Placement:
    """This process's placement, from ``torchrun``'s WORLD_SIZE / RANK / LOCAL_RANK. A
    distributed run joins its process group here (NCCL on GPUs, after binding the process to
    its own GPU so that NCCL does not put every rank on GPU 0; gloo on CPUs)."""
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return Placement(world, rank, torch.device(f"cuda:{local_rank}" if cuda else "cpu"))


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of ``precision`` on ``device`` (None = fp32). ``auto`` is bf16 where
    the hardware has it natively (CUDA with bf16, CPUs with AVX-512 BF16 or AMX), fp16 on
    older GPUs, else fp32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected auto, fp32, bf16 or fp16")
    if precision != "auto":
        return DTYPES[precision]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    flags = {f for line in _cpuinfo("flags") for f in line.split()}
    return torch.bfloat16 if flags & {"avx512_bf16", "amx_bf16"} else None


def precision_name(dtype: torch.dtype | None) -> str:
    return {d: name for name, d in DTYPES.items()}[dtype]


def _cpuinfo(key: str) -> list[str]:
    """The values of the ``key`` lines of :data:`CPUINFO`; none where it cannot be read."""
    try:
        lines = CPUINFO.read_text().splitlines()
    except OSError:
        return []
    return [line.partition(":")[2].strip() for line in lines if line.startswith(key)]


def describe_device(device: torch.device) -> dict[str, Any]:
    """What computed: the GPU's name, or the CPU's model and the threads torch uses."""
    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device), "count": torch.cuda.device_count()}
    names = _cpuinfo("model name")
    return {"type": "cpu", "name": names[0] if names else platform.processor() or platform.machine(),
            "threads": torch.get_num_threads()}


def versions() -> dict[str, str]:
    """The versions a result records (``cuda``: the CUDA torch was built with, or None)."""

    return {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "structinit": structinit.__version__, "platform": platform.platform()}
