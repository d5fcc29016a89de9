"""Sharded training (learner.parallel=fsdp): FSDP2 (`torch.distributed.fsdp.fully_shard`) over accelerate's group.

Why FSDP2 called directly, not FSDP1 through accelerate's plugin: fully_shard runs on the CPU with gloo (all-gather and
reduce-scatter of DTensor shards; tests/test_fsdp.py trains on 2 CPU processes), it needs no `distributed_type: FSDP`
accelerate config (the same `accelerate launch --multi_gpu` command as data parallelism, gloo or NCCL), and it leaves
the learner in charge of what FSDP1-through-accelerate hides: the gradient divide factor (the trainer's chunk weights
make the SUM of the ranks' gradients the one-process gradient, so FSDP must not average), the extra entry points
(TrainPolicy.logprobs_at / values_at, not forward()), and full state dicts gathered with the checkpoint's names.

What sharding changes (learner/ppo.py reads `PPOTrainer.fsdp`):
- Each decoder layer (the classes transformers lists in `_no_split_modules`) is its own FSDP unit; the rest
  (embeddings, final norm, lm_head, the value head, the vision module) is the root unit. Parameters become DTensors
  sharded on dim 0; the optimizers are built on them afterwards, so AdamW's state is sharded too.
- Every forward all-gathers a unit's parameters and every backward reduce-scatters its gradients, so every rank must
  run the same number of forward / backward calls: a rank short of a chunk runs a zero-weight one (ppo.py).
  Gradients come out summed (divide factor 1), and `Dist.allreduce_grads` is not called.
- Gradient-norm clipping over the shards: clip_grad_norm_ on DTensor gradients reduces the norm over the group, so
  every rank clips by, and decides finiteness on, the same global norm.
- A Qwen2-VL / Qwen2.5-VL model (TrainPolicy.vl): its vision blocks (`_no_split_modules` names them beside the decoder
  layers) are units too; the vision tower's other parameters (patch embedding, merger) are in the root unit. A unit's
  collectives run per call of its module, so the calls must not depend on a rank's data: the policy runs the language
  model once per hidden() (`one_vl_forward`: all segments of the chunk in one forward, not packed into several), and
  the vision tower exactly once, before the language model (`_vl_hidden_once`: a chunk without images runs it on one
  blank image, its output added times 0 to the embeddings, so the vision units all-gather and reduce-scatter, with
  zero gradients, in the same order as on the other ranks).
  model.freeze_vision: FSDP2 keeps requires_grad per parameter (frozen vision blocks reduce-scatter nothing, the root
  unit mixes frozen and trainable ones); freeze before sharding (learner/main.py does), the optimisers skip them.
- Full state: `full(t)` (collective), `full_state(module)`, `full_optim_state(opt)` gather on every rank in the same
  order (TrainPolicy.hf_state_dict gathers its tensors; `gathered(policy)` holds them for rank 0's writers);
  `load_state` / `load_optim_state` scatter full tensors (a 1-process checkpoint) back into shards.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

try:  # public since torch 2.4; the learner only shards when asked
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # pragma: no cover - old torch
    DTensor = ()  # type: ignore[assignment]
    distribute_tensor = None

# TrainPolicy methods the trainer calls directly (not through __call__, whose forward hooks FSDP already has)
ENTRY_POINTS = ("logprobs_at", "values_at")


def is_sharded(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def shard(model: nn.Module, world: int, device: torch.device) -> nn.Module:
    """fully_shard `model` (a TrainPolicy) in place over the default process group: decoder layers, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh(device.type, (world,))
    layer_names = set(getattr(model.lm, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_names]
    if not layers:
        raise ValueError(f"{type(model.lm).__name__}: no decoder layer class to shard (no _no_split_modules)")
    for m in layers:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for name in ENTRY_POINTS:  # all-gather the root unit around these too, not only around forward()
        if hasattr(model, name):
            register_fsdp_forward_method(model, name)
    if getattr(model, "vl", None) is not None:
        model.one_vl_forward = True
        model.hidden = _vl_hidden_once(model, model.hidden)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # a sum, not a mean: the chunks' loss weights already divide
            m.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    return model


def _vl_hidden_once(model: nn.Module, hidden):
    """model.hidden for a sharded VL policy: the vision tower and the language model run exactly once per call, the
    tower first, on every rank (a unit all-gathers at each call of its module, so the order must match too). A call
    whose chunk has no image runs the tower on one blank image just before the language model, as transformers runs
    it on real ones, and adds its output times 0 to the input embeddings: the same collectives, zero gradients."""
    visual, language = model.lm.model.visual, model.lm.model.language_model

    def blank():
        c, m = visual.config, visual.spatial_merge_size
        dim = c.in_channels * c.temporal_patch_size * c.patch_size ** 2
        dev = next(iter(visual.parameters())).device
        out = visual(torch.zeros(m * m, dim, device=dev, dtype=visual.dtype),
                     grid_thw=torch.tensor([[1, m, m]], device=dev))
        return out.pooler_output if getattr(out, "pooler_output", None) is not None else out[0]

    def once(*args, **kwargs):
        seen = {"visual": 0, "language": 0}

        def on_visual(*_):
            seen["visual"] += 1

        def on_language(_mod, a, kw):
            seen["language"] += 1
            if seen["visual"] == 0 and seen["language"] == 1:
                if kw.get("inputs_embeds") is None:
                    raise RuntimeError("sharded VL forward: the language model was called without inputs_embeds")
                y = blank()
                kw = {**kw, "inputs_embeds": kw["inputs_embeds"] + 0.0 * y.sum().to(kw["inputs_embeds"].dtype)}
            return a, kw

        hooks = [visual.register_forward_pre_hook(on_visual),
                 language.register_forward_pre_hook(on_language, with_kwargs=True)]
        try:
            h = hidden(*args, **kwargs)
        finally:
            for hk in hooks:
                hk.remove()
        if seen != {"visual": 1, "language": 1}:  # one_vl_forward rules this out; a mismatch would hang the group
            raise RuntimeError(f"sharded VL forward ran the vision tower {seen['visual']} and the language model "
                               f"{seen['language']} times (once each expected)")
        return h

    return once


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an all-gather when it is a DTensor shard: every rank calls it, in the same order)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def like(ref: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` (a whole tensor, the same on every rank) placed as `ref` is: sharded like a DTensor `ref`."""
    if isinstance(ref, DTensor):
        return distribute_tensor(value.to(ref.device, ref.dtype), ref.device_mesh, ref.placements)
    return value


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """module.state_dict() with whole tensors on the CPU, on every rank (collective)."""
    return {k: full(v).detach().to("cpu") for k, v in module.state_dict().items()}


@contextlib.contextmanager
def gathered(policy: nn.Module, sd: dict[str, torch.Tensor] | None = None):
    """policy.hf_state_dict() (so save_hf, publishing) answers `sd` inside: the sharded policy's state gathered once
    by every rank (without sd: gathered now, a collective), then written by rank 0 alone."""
    policy._gathered = sd if sd is not None else policy.hf_state_dict()
    try:
        yield policy._gathered
    finally:
        policy._gathered = None


def load_state(module: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """load_state_dict of whole tensors into a module that may be sharded (every rank, the same sd)."""
    own = module.state_dict()
    module.load_state_dict({k: like(own[k], v) if k in own else v for k, v in sd.items()})


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def full_optim_state(opt: torch.optim.Optimizer) -> dict:
    """opt.state_dict() with whole tensors: the layout of an unsharded optimizer (collective)."""
    sd = opt.state_dict()
    sd["state"] = {i: {k: full(v).detach().to("cpu") if torch.is_tensor(v) else v for k, v in s.items()}
                   for i, s in sd["state"].items()}
    return sd


def load_optim_state(opt: torch.optim.Optimizer, sd: dict) -> None:
    """opt.load_state_dict of an unsharded optimizer's state into one over (possibly) sharded parameters."""
    params = _params(opt)
    state = {}
    for i, s in sd["state"].items():
        p = params[int(i)]
        state[i] = {k: like(p, v) if torch.is_tensor(v) and v.shape == p.shape else v for k, v in s.items()}
    opt.load_state_dict({**sd, "state": state})
