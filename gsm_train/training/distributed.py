"""Process group, device and FSDP2 sharding (owned here so that CPU/gloo tests run the GPU code path)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from gsm_train.errors import GSMError
from gsm_train.models.families import attention_modules, decoder_layers


@dataclass(frozen=True)
class DistInfo:
    """Where this process runs."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def cuda_wanted() -> bool:
    """Whether work goes to CUDA: a GPU is there and `ACCELERATE_USE_CPU` (as `accelerate launch --cpu`
    sets it) does not say otherwise."""
    return torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true", "yes")


class LaunchError(GSMError):
    """The launcher started this process alone where the command asked for several."""


_TRUE = ("1", "true", "yes")
_MPI_SIZES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")  # as accelerate's PartialState reads them
_TORCHRUN = "torchrun --nproc_per_node N -m gsm_train.train --recipe RECIPE [key=value ...]"


def check_launch(env: Mapping[str, str]) -> None:
    """Raise LaunchError for a launch whose processes would each run alone, unaware of the others:
    `accelerate launch --cpu --num_processes N` (N > 1), which starts one process (accelerate runs
    several CPU processes only through mpirun; its one process gets MASTER_PORT but no WORLD_SIZE), or
    mpirun, whose ranks get no WORLD_SIZE either. torchrun (or accelerate on GPUs) sets WORLD_SIZE."""
    if "WORLD_SIZE" in env:
        return
    mpi = next((env[name] for name in _MPI_SIZES if name in env), "1")
    if mpi.isdigit() and int(mpi) > 1:
        raise LaunchError(
            f"mpirun started {mpi} processes, but gsm-train joins a process group through torchrun's "
            f"variables (WORLD_SIZE, RANK), which mpirun does not set: each would train alone. Fix: {_TORCHRUN}"
        )
    if env.get("ACCELERATE_USE_CPU", "").lower() in _TRUE and "MASTER_PORT" in env:
        raise LaunchError(
            "accelerate launch --cpu with --num_processes above 1 started this one process only (accelerate "
            "runs several CPU processes only through mpirun), so it would train alone. Fix: for several CPU "
            f"processes (gloo, the GPU code path): {_TORCHRUN}; or drop --num_processes for one"
        )


def init_distributed(force_cpu: bool = False) -> DistInfo:
    """Join the process group that `accelerate launch`/`torchrun` set up (gloo on CPU, NCCL on GPU);
    LaunchError for a launch that started fewer processes than asked (`check_launch`)."""
    check_launch(os.environ)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = cuda_wanted() and not force_cpu
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def shard_model(model: nn.Module, compute_dtype: torch.dtype | None) -> nn.Module:
    """FSDP2: each GSM module, then each decoder layer, then the root; all gradients reduced in fp32.

    The GSM modules (gate, ASQ, bridge) are their own units because they keep fp32 parameters next
    to a base that may be bf16 (an FSDP unit holds one dtype), and so that their gradients are
    reduced even when the frozen decoder layer around them has no gradient to propagate.
    """
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer, attention in zip(decoder_layers(model), attention_modules(model), strict=True):
        adapter = getattr(attention, "gsm", None)
        for module in adapter.children() if adapter is not None else ():
            fully_shard(module, mp_policy=policy, reshard_after_forward=False)
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (a no-op in one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor


class OtherRankFailed(GSMError):
    """Raised on the ranks that had no error when another rank of the launch had one."""


def raise_on_any_rank(info: DistInfo, error: Exception | None) -> None:
    """Collective: if any rank has an error, raise it on that rank and OtherRankFailed on the
    others, so that a check made by one rank (e.g. rank 0 writing) stops every rank together."""
    failed = error is not None
    if info.distributed and dist.is_initialized():
        flag = torch.tensor([float(failed)], device=info.device)
        failed = all_reduce_sum(flag).item() > 0
    if error is not None:
        raise error
    if failed:
        raise OtherRankFailed("another process of this launch stopped with an error (see its message)")


def barrier() -> None:
    """Wait for all ranks (a no-op in one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def teardown() -> None:
    """Leave the process group."""
    if dist.is_initialized():
        dist.destroy_process_group()
