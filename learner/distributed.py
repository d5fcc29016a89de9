"""Data-parallel training under `accelerate launch`: same parameters as one process on the same data.

    accelerate launch --num_processes 2 --cpu -m tars.cli learner ...      (gloo on the CPU)
    accelerate launch --num_processes 8 -m tars.cli learner ...            (nccl; --set learner.parallel=fsdp: learner/fsdp.py)

Rank 0 owns everything that talks to the outside (the stream, the control server, publishing, checkpoints); it
broadcasts each batch to the other ranks. Every rank then computes the whole-batch quantities (proximal logprobs,
values, advantages and their normalisation, GRPO groups), so those are identical everywhere, and the loss over its
own share of the length-bucketed chunks. Each chunk's loss is already weighted by its share of the minibatch's
tokens (see PPOTrainer.step), so the SUM of the ranks' gradients is exactly the one-process gradient: it is
all-reduced before clipping, and every rank takes the same optimizer step. We all-reduce by hand instead of
wrapping the model in DDP because ranks may hold different numbers of chunks (DDP would hang on the mismatch) and
gradient accumulation over chunks would otherwise sync on every backward.
"""
from __future__ import annotations

import os

import torch


class Dist:
    """The process group as the trainer needs it. world == 1 is a no-op (no accelerate, no torch.distributed)."""

    def __init__(self, rank: int = 0, world: int = 1, accelerator=None, device: torch.device | None = None):
        self.rank, self.world, self.accelerator = rank, world, accelerator
        # Where collective buffers live: NCCL only moves CUDA tensors, gloo CPU ones.
        self.device = device if device is not None else torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, items: list) -> list:
        """This rank's share of a list that every rank holds in the same order (round robin)."""
        return items[self.rank::self.world] if self.world > 1 else items

    def allreduce_grads(self, params) -> None:
        """Sum the gradients of `params` over the ranks (a rank with no chunk contributes zeros).

        One flat buffer, one collective: on gloo a collective per tensor costs far more than the bytes."""
        if self.world == 1:
            return
        params = [p for p in params if p.requires_grad]
        # A parameter no rank touched (e.g. the critic's unused lm_head) must keep grad None, as in one process:
        # the optimizer skips it then, whereas a zero gradient would still apply AdamW's weight decay.
        seen = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=self.device)
        torch.distributed.all_reduce(seen, op=torch.distributed.ReduceOp.SUM)
        params = [p for p, s in zip(params, seen.tolist()) if s]
        if not params:  # no rank trained a token in this minibatch: nothing to sum (every rank sees the same `seen`)
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
        off = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[off:off + n].view_as(p.grad))
            off += n

    def sum_floats(self, xs: list[float]) -> list[float]:
        if self.world == 1:
            return xs
        t = torch.tensor(xs, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
        return t.cpu().tolist()

    def broadcast(self, obj):
        """rank 0's `obj` on every rank (pickled: only between our own ranks, never from the network)."""
        if self.world == 1:
            return obj
        box = [obj if self.is_main else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()


def launched_world() -> int:
    """Processes started by accelerate/torchrun for this job (1 when run directly)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def from_accelerate(cpu: bool | None = None, device: torch.device | None = None, timeout_s: float | None = None) -> Dist:
    """Initialise the process group through accelerate when launched by it: the backend follows the device.

    device: where this process trains (learner/device.py resolve_device: cuda:LOCAL_RANK under accelerate) ->
    NCCL for a CUDA device, gloo for the CPU. Without it, `cpu` decides (default: gloo unless CUDA is available).
    timeout_s: the process group's timeout (learner.dist_timeout_s; accelerate's default otherwise: 30 min on gloo,
    10 min on NCCL), the longest a collective waits for the other ranks.
    """
    if device is not None:
        cpu = device.type != "cuda"
    elif cpu is None:
        cpu = not torch.cuda.is_available()
    if launched_world() == 1:
        return Dist(device=device if device is not None else torch.device("cpu"))
    import datetime

    from accelerate import Accelerator, InitProcessGroupKwargs

    if not cpu and device is not None:
        torch.cuda.set_device(device)  # before the NCCL group forms: each rank on its own GPU
    kw = [] if timeout_s is None else [InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=timeout_s))]
    acc = Accelerator(cpu=cpu, kwargs_handlers=kw)  # accelerate picks nccl for GPUs, gloo for cpu=True
    return Dist(acc.process_index, acc.num_processes, acc, device=acc.device if not cpu else torch.device("cpu"))


def backend() -> str:
    """The process group's backend ('gloo', 'nccl'), or '' when there is none (one process)."""
    return torch.distributed.get_backend() if torch.distributed.is_available() and torch.distributed.is_initialized() else ""
