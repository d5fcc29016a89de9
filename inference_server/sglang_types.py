"""Checks of the conformance server's requests against the `sglang` package's own request types, where importable.

The conformance server reproduces SGLang's behaviour by hand; where `sglang` is installed (a GPU machine), each
request body is also built into SGLang's own dataclasses (io_struct.GenerateReqInput & co., whose constructors
refuse unknown fields and whose normalize_batch_and_arguments() checks the combination) and its sampling params
into sglang.srt.sampling_params.SamplingParams (verify()), so a body that SGLang itself would refuse is refused
here too, with SGLang's message. Where the package is absent, `SGLangTypes.load()` returns a checker whose
`available` is False and whose check() does nothing: the hand-written checks of the conformance server remain.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging

log = logging.getLogger("tars.inference.sglang_types")

# endpoint -> the io_struct class SGLang's http_server builds from its body
ENDPOINT_TYPES = {
    "/generate": "GenerateReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/pause_generation": "PauseGenerationReqInput",
}


class SGLangTypes:
    def __init__(self, io_struct=None, sampling_params_cls=None, version: str = ""):
        self.io, self.sp_cls, self.version = io_struct, sampling_params_cls, version

    @property
    def available(self) -> bool:
        return self.io is not None

    @classmethod
    def load(cls) -> "SGLangTypes":
        """The checker over the installed `sglang`, or an inactive one when it cannot be imported."""
        try:
            io = importlib.import_module("sglang.srt.managers.io_struct")
            sp = importlib.import_module("sglang.srt.sampling_params").SamplingParams
        except Exception as e:  # not installed, or installed without its GPU dependencies
            log.debug("sglang request types not importable (%s: %s); conformance checks only", type(e).__name__, e)
            return cls()
        version = getattr(importlib.import_module("sglang"), "__version__", "")
        return cls(io, sp, version)

    def check(self, path: str, body: dict, vocab_size: int | None = None) -> None:
        """Raise ValueError with SGLang's own message when SGLang's types refuse `body` for `path`."""
        if not self.available:
            return
        name = ENDPOINT_TYPES.get(path)
        typ = getattr(self.io, name, None) if name else None
        if typ is None:
            return
        if dataclasses.is_dataclass(typ):  # fields SGLang does not know are a TypeError in its own constructor
            known = {f.name for f in dataclasses.fields(typ)}
            unknown = sorted(set(body) - known)
            if unknown:
                raise ValueError(f"{name} has no field(s) {unknown}")
        try:
            obj = typ(**body)
            norm = getattr(obj, "normalize_batch_and_arguments", None)
            if norm is not None:
                norm()
        except (TypeError, ValueError, AssertionError) as e:
            raise ValueError(f"{name}: {e}") from e
        if path == "/generate" and self.sp_cls is not None:
            self._check_sampling(body.get("sampling_params") or {}, vocab_size)

    def _check_sampling(self, sp: dict, vocab_size: int | None) -> None:
        try:
            p = self.sp_cls(**sp)
            verify = getattr(p, "verify", None)
            if verify is not None:
                # verify() took no arguments in older releases and vocab_size in newer ones.
                n = len(inspect.signature(verify).parameters)
                verify(vocab_size) if n >= 1 and vocab_size is not None else verify() if n == 0 else None
        except (TypeError, ValueError, AssertionError) as e:
            raise ValueError(f"SamplingParams: {e}") from e
