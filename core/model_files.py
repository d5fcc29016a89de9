"""A checkpoint directory's weights, as transformers lays them out: one model.safetensors, or shards named
model-00001-of-0000N.safetensors listed in model.safetensors.index.json ({"metadata": {"total_size"}, "weight_map"});
and its config.json's RoPE in both transformers spellings (both_rope_spellings); and the random initialisation
of weights by name (init_parameters).
"""
from __future__ import annotations

import json
import os
import pathlib

import torch

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


class MissingWeights(FileNotFoundError):
    """A checkpoint directory without (all of) its weights."""


def has_weights(path: str | os.PathLike) -> bool:
    path = pathlib.Path(path)
    return (path / WEIGHTS_NAME).is_file() or (path / INDEX_NAME).is_file()


def read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """DIR -> {name: tensor} from model.safetensors or the sharded index; MissingWeights names DIR and what lacks."""
    from safetensors.torch import load_file

    path = pathlib.Path(path)
    if not path.is_dir():
        raise MissingWeights(f"{path}: no such checkpoint directory")
    if (path / WEIGHTS_NAME).is_file():
        return load_file(str(path / WEIGHTS_NAME))
    if not (path / INDEX_NAME).is_file():
        other = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf", ".safetensors"))
        hint = f"; found {other} (only {WEIGHTS_NAME} or a sharded {INDEX_NAME} are read)" if other else ""
        raise MissingWeights(f"{path}: no weights: neither {WEIGHTS_NAME} nor {INDEX_NAME} is there{hint}")
    try:
        weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]
        if not (isinstance(weight_map, dict) and weight_map):
            raise ValueError("weight_map is not a non-empty mapping")
    except Exception as e:
        raise ValueError(f"{path / INDEX_NAME}: not a safetensors index with a weight_map ({type(e).__name__}: {e})") from None
    shards = sorted(set(weight_map.values()))
    bad = [s for s in shards if not isinstance(s, str) or pathlib.PurePath(s).name != s]
    if bad:
        raise ValueError(f"{path / INDEX_NAME}: shard names must be plain file names in the directory, got {bad[:3]}")
    missing = [s for s in shards if not (path / s).is_file()]
    if missing:
        raise MissingWeights(f"{path}: {INDEX_NAME} lists shards that are not there: {missing[:5]}")
    sd: dict[str, torch.Tensor] = {}
    for s in shards:
        sd.update(load_file(str(path / s)))
    absent = [k for k in weight_map if k not in sd]
    if absent:
        raise MissingWeights(f"{path}: {INDEX_NAME} maps tensors that no shard holds: {absent[:5]}")
    return sd


MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit on the JSON header


def check_file(path: pathlib.Path) -> set[str]:
    """A safetensors file's header read without its tensors: an 8-byte length, a JSON header whose tensors' byte
    ranges lie in the data that follows and cover it exactly, as safetensors itself requires. ValueError (one line,
    naming the file) for a truncated, empty or otherwise unreadable file; returns the tensor names."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path}: not a whole safetensors file ({size} bytes, header length "
                             f"{'unreadable' if n < 0 else n}): truncated or corrupt; copy it again")
        try:
            header = json.loads(fh.read(n))
            if not isinstance(header, dict):
                raise ValueError("not a mapping")
        except (ValueError, UnicodeDecodeError):
            raise ValueError(f"{path}: its safetensors header is not a JSON mapping: corrupt; copy it again") from None
    end = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = (int(x) for x in t["data_offsets"])
            if not 0 <= begin <= stop:
                raise ValueError("offsets out of order")
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"{path}: tensor {name!r} has no valid data_offsets in its header: corrupt") from None
        end = max(end, stop)
    if end != size - 8 - n:
        raise ValueError(f"{path}: its header describes {end} bytes of tensor data but the file holds {size - 8 - n}: "
                         "truncated or corrupt; copy it again")
    return set(header) - {"__metadata__"}


def check_weights(path: str | os.PathLike) -> None:
    """The weights of checkpoint directory DIR can be read, judged by their headers (check_file) and, for shards, the
    index: MissingWeights / ValueError naming the file, before a process spends time on a model it cannot load."""
    path = pathlib.Path(path)
    if (path / WEIGHTS_NAME).is_file():
        check_file(path / WEIGHTS_NAME)
        return
    if not (path / INDEX_NAME).is_file():
        read_weights(path)  # raises MissingWeights, naming what is there instead
    try:
        weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]
        if not (isinstance(weight_map, dict) and weight_map and all(isinstance(s, str) for s in weight_map.values())):
            raise ValueError("weight_map is not a non-empty mapping of names to shard files")
    except Exception as e:
        raise ValueError(f"{path / INDEX_NAME}: not a safetensors index with a weight_map ({type(e).__name__})") from None
    shards = sorted(set(weight_map.values()))
    bad = [s for s in shards if pathlib.PurePath(s).name != s]
    if bad:
        raise ValueError(f"{path / INDEX_NAME}: shard names must be plain file names in the directory, got {bad[:3]}")
    missing = [s for s in shards if not (path / s).is_file()]
    if missing:
        raise MissingWeights(f"{path}: {INDEX_NAME} lists shards that are not there: {missing[:5]}")
    held: set[str] = set()
    for s in shards:
        held |= check_file(path / s)
    absent = [k for k in weight_map if k not in held]
    if absent:
        raise MissingWeights(f"{path}: {INDEX_NAME} maps tensors that no shard holds: {absent[:5]}")


def newest_published(wdir: str | os.PathLike) -> tuple[pathlib.Path, int] | None:
    """The newest whole weights/vN in a run's weights directory (numerically: v10 after v9; a version still being
    written has a temporary name) and its N, or None when there is none."""
    n, d = max(((int(d.name[1:]), d) for d in pathlib.Path(wdir).glob("v*") if d.name[1:].isdigit()),
               default=(-1, None))
    return (d, n) if d is not None else None


def write_weights(path: str | os.PathLike, sd: dict[str, torch.Tensor], max_shard_bytes: int | None = None) -> list[str]:
    """Write sd into the directory DIR as model.safetensors, or, when it exceeds max_shard_bytes, as shards + index
    (a tensor larger than the limit gets a shard of its own, as in transformers). Returns the file names written."""
    from safetensors.torch import save_file

    path = pathlib.Path(path)
    meta = {"format": "pt"}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in sd.items():
        n = v.numel() * v.element_size()
        if max_shard_bytes and shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    if len(shards) == 1:
        save_file(shards[0], str(path / WEIGHTS_NAME), metadata=meta)
        return [WEIGHTS_NAME]
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, str(path / name), metadata=meta)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(v.numel() * v.element_size() for v in sd.values())
    (path / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names + [INDEX_NAME]


def untied_head(sd: dict) -> bool:
    """A config that says tie_word_embeddings, over weights whose lm_head.weight differs from the embedding (a
    fine-tune exported with both): transformers then unties and uses the file's lm_head; so do the engine and the
    learner (TrainPolicy.load), so that both compute the model transformers computes and publish the head."""
    head, emb = sd.get("lm_head.weight"), sd.get("model.embed_tokens.weight")
    return head is not None and emb is not None and (head.shape != emb.shape or not torch.equal(head, emb))


def both_rope_spellings(d: dict) -> dict:
    """A config.json dict as transformers 5 writes it (the RoPE base and scaling only in `rope_parameters`, at the top
    or in a VL model's text_config) with transformers 4's spelling beside it: `rope_theta`, and `rope_scaling` for
    a scaled or multimodal RoPE (llama3, linear, Qwen-VL's mrope_section). Readers on transformers 4 (SGLang, vLLM,
    an older user) otherwise load such a checkpoint with plain RoPE: silently another model. transformers 5 reads
    the result back as before (rope_scaling is its legacy name for the same dict)."""
    out = dict(d)
    for key in (None, "text_config"):
        if key is not None and not isinstance(out.get(key), dict):
            continue
        level = out if key is None else dict(out[key])
        rp = level.get("rope_parameters")
        if isinstance(rp, dict) and not {"full_attention", "sliding_attention"} & set(rp):
            if level.get("rope_theta") is None and "rope_theta" in rp:
                level["rope_theta"] = rp["rope_theta"]
            scaling = {k: v for k, v in rp.items() if k not in ("rope_theta", "partial_rotary_factor")}
            if not level.get("rope_scaling") and (
                    "mrope_section" in scaling or (scaling.get("rope_type") or scaling.get("type") or "default") != "default"):
                level["rope_scaling"] = scaling
        if key is not None:
            out[key] = level
    return out


def init_parameters(module: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """A random initialisation by parameter name, the same for every module with the same names in the same order
    (the engine's CausalLM and the learner's TrainPolicy): norms 1, biases 0, the rest N(0, std) from one generator."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
