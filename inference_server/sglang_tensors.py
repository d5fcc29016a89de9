"""The body of SGLang's POST /update_weights_from_tensor, both ends (SGLang 0.5.23).

SGLang's body is {serialized_named_tensors: [one str per TP rank], load_format, flush_cache, abort_all_requests,
weight_version}; each string is what sglang.srt.utils' MultiprocessingSerializer.serialize(named_tensors,
output_str=True) makes: the list [(name, tensor), ...] pickled with multiprocessing's ForkingPickler (so torch's
reductions move each tensor's storage to shared memory and pickle only a *handle* to it), then base64. The server
maps the handles, so the bytes are never copied through the HTTP body: same host only, and the sender must keep the
tensors alive until the server answered. Here CPU tensors go through torch's file_system sharing strategy (a named
shared-memory file handed out by torch_shm_manager), which unrelated processes can open.

Pickle means the receiver trusts the sender (docs/threat-model.md): the client only talks to loopback servers with
it, and the decoder here (used by the conformance server) unpickles through an allow-list of torch's rebuild
functions and types, refusing anything else, as SGLang's own SafeUnpickler restricts the modules it loads from.
"""
from __future__ import annotations

import base64
import binascii
import io
import pickle
import urllib.parse
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as tmp
import torch.multiprocessing.reductions  # noqa: F401 - registers torch's ForkingPickler reductions

from core.auth import is_loopback

_ALLOWED = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
    ("torch", "Tensor"), ("torch", "Size"), ("torch.nn.parameter", "Parameter"),
    ("torch", "float32"), ("torch", "bfloat16"), ("torch", "float16"),
    ("collections", "OrderedDict"),
}


class BadTensors(ValueError):
    """serialized_named_tensors cannot be decoded into (name, tensor) pairs."""


def same_host(url: str) -> bool:
    return is_loopback(urllib.parse.urlsplit(url).hostname or "")


def share(state_dict: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The state dict as CPU tensors in shared memory (file_system strategy); keep them alive while a server maps them."""
    tmp.set_sharing_strategy("file_system")  # fd passing needs a parent/child pair; unrelated processes open names
    out = []
    for k, t in state_dict.items():
        t = t.detach().to("cpu").contiguous()
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            t = t.float()
        out.append((k, t.share_memory_() if t.numel() else t))
    return out


def serialize(named: list[tuple[str, torch.Tensor]]) -> str:
    """One rank's serialized_named_tensors entry (MultiprocessingSerializer.serialize(..., output_str=True))."""
    tmp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode()


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in _ALLOWED:
            raise BadTensors(f"refused to unpickle {module}.{name}")
        return super().find_class(module, name)


def deserialize(entry) -> list[tuple[str, torch.Tensor]]:
    """One rank's entry -> [(name, tensor)]; BadTensors for anything else."""
    if not isinstance(entry, str):
        raise BadTensors(f"serialized_named_tensors entries are base64 strings, not {type(entry).__name__}")
    try:
        raw = base64.b64decode(entry, validate=True)
        obj = _Unpickler(io.BytesIO(raw)).load()
    except BadTensors:
        raise
    except (binascii.Error, pickle.UnpicklingError, EOFError, ValueError, TypeError, RuntimeError, AttributeError, IndexError) as e:
        raise BadTensors(f"cannot decode serialized_named_tensors: {type(e).__name__}: {e}") from e
    if isinstance(obj, dict):
        obj = list(obj.items())
    if not isinstance(obj, list) or not all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)
                                            and isinstance(x[1], torch.Tensor) for x in obj):
        raise BadTensors("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return obj
