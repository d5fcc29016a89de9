"""Weights as a stream of raw tensor pieces (InferenceService.UpdateWeightsStream), both ends.

One UpdateWeights message holds at most max_message_bytes, and a ~0.5B model in bf16 is already ~1 GB, so engines
without a shared disk get the weights as WeightsChunk messages: each tensor announced once (name, dtype, shape)
and its raw bytes split into pieces of at most `piece_bytes`. The receiver checks every tensor against the
engine's own names and shapes as soon as it is announced, so a wrong checkpoint is refused before its bytes are
read, and holds at most the model's size in memory (each tensor must arrive at exactly its announced size).
Plain data only: nothing is unpickled.
"""
from __future__ import annotations

from typing import Iterator

import torch

from core.v1 import inference_pb2

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NAMES = {v: k for k, v in DTYPES.items()}


class BadChunk(ValueError):
    """The stream itself is malformed (INVALID_ARGUMENT)."""


class WrongWeights(ValueError):
    """Well-formed, but not weights of this model (FAILED_PRECONDITION)."""


def chunks(version: int, state_dict: dict[str, torch.Tensor], piece_bytes: int = 4 << 20) -> Iterator[inference_pb2.WeightsChunk]:
    """The WeightsChunk messages that carry `state_dict` as `version` (first message carries the version)."""
    first = True
    for name, t in state_dict.items():
        t = t.detach().to("cpu").contiguous()
        if t.dtype not in _NAMES:
            t = t.float()
        # A view of the tensor's bytes: each piece is copied once, into its message (not the whole tensor first).
        raw = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        for i, off in enumerate(range(0, max(len(raw), 1), piece_bytes)):
            c = inference_pb2.WeightsChunk(data=bytes(raw[off:off + piece_bytes]))
            if i == 0:
                c.name, c.dtype = name, _NAMES[t.dtype]
                c.shape.extend(t.shape)
            if first:
                c.version, first = int(version), False
            yield c


class Assembler:
    """Receives WeightsChunk messages in order and builds the state dict.

    shapes: the engine's {name: shape}; tensors it does not name are refused at once. `tied` names may be absent.
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]], optional: frozenset[str] = frozenset()):
        self.shapes, self.optional = shapes, optional
        self.version: int | None = None
        self.out: dict[str, torch.Tensor] = {}
        self._name = ""
        self._dtype: torch.dtype | None = None
        self._shape: tuple[int, ...] = ()
        self._buf: torch.Tensor | None = None  # the tensor being received, and a writable view of its bytes
        self._view: memoryview | None = None
        self._got = self._want = 0

    def add(self, c: inference_pb2.WeightsChunk) -> None:
        if self.version is None:
            if c.version <= 0:
                raise BadChunk("the first WeightsChunk must carry the version (> 0)")
            self.version = int(c.version)
        elif c.version and c.version != self.version:
            raise BadChunk(f"WeightsChunk version {c.version} differs from the stream's version {self.version}")
        if c.name and c.name != self._name:
            self._close_tensor()
            self._open_tensor(c)
        elif not self._name:
            raise BadChunk("a WeightsChunk continues no tensor (the first piece of a tensor must name it)")
        n = len(c.data)
        if self._got + n > self._want:
            raise BadChunk(f"tensor {self._name}: more bytes than its shape {list(self._shape)} in {_NAMES[self._dtype]} holds ({self._want})")
        self._view[self._got:self._got + n] = c.data  # into the tensor's own buffer, allocated once at its size
        self._got += n

    def _open_tensor(self, c) -> None:
        name = c.name
        if name in self.out:
            raise BadChunk(f"tensor {name} sent twice")
        if c.dtype not in DTYPES:
            raise BadChunk(f"tensor {name}: dtype {c.dtype!r} is not one of {sorted(DTYPES)}")
        if name not in self.shapes:
            raise WrongWeights(f"tensor {name} is not a weight of this model")
        shape = tuple(int(x) for x in c.shape)
        if shape != tuple(self.shapes[name]):
            raise WrongWeights(f"tensor {name}: shape {list(shape)} vs the model's {list(self.shapes[name])}")
        self._name, self._dtype, self._shape = name, DTYPES[c.dtype], shape
        n = 1
        for x in shape:
            n *= x
        self._want = n * torch.tensor([], dtype=self._dtype).element_size()
        self._buf = torch.empty(self._want, dtype=torch.uint8)  # the size was checked against the model: bounded
        self._view, self._got = memoryview(self._buf.numpy()), 0

    def _close_tensor(self) -> None:
        if not self._name:
            return
        if self._got != self._want:
            raise BadChunk(f"tensor {self._name}: {self._got} bytes received, {self._want} expected")
        self._view.release()
        self.out[self._name] = self._buf.view(self._dtype).reshape(self._shape)
        self._name, self._buf, self._view, self._got = "", None, None, 0

    def finish(self) -> tuple[int, dict[str, torch.Tensor]]:
        self._close_tensor()
        if self.version is None:
            raise BadChunk("empty weights stream")
        missing = sorted(set(self.shapes) - set(self.out) - self.optional)
        if missing:
            raise WrongWeights(f"weights stream ended without {len(missing)} tensors, e.g. {missing[:3]}")
        return self.version, self.out
