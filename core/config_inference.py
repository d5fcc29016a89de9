"""The inference server's configuration (`inference.*`): the gRPC front, the local engine, its prefix cache and the
SGLang backend (docs/model.md, docs/sglang.md)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from core.config_fields import f

DEVICES = "auto | cpu | cuda | cuda:N"
PRECISIONS = ("fp32", "bf16", "fp16")
# engine=sglang, SGLang with context length C: its tokenizer manager refuses prompt + max_new_tokens >= C
# (_validate_one_request), its scheduler refuses a prompt of max_req_input_len = C - 6 tokens or more
# (validate_input_length; a generation resumed after an abort is such a prompt, its tokens so far appended) and caps
# max_new_tokens at C - prompt - 2. prompt + max_new_tokens <= C - 6 satisfies all three, resumes included.
SGLANG_CONTEXT_MARGIN = 6


def device_error(spec: str, what: str) -> str:
    """The syntax of a device setting: "" when fine, else the message (core.device resolves it on this machine)."""
    s = (spec or "").strip().lower()
    if s in ("auto", "cpu") or re.fullmatch(r"cuda(:\d+)?", s):
        return ""
    return f"{what}: {spec!r} is not one of {DEVICES}"


def precision_error(spec: str, what: str) -> str:
    s = (spec or "").strip().lower()
    return "" if s == "auto" or s in PRECISIONS else f"{what}: {spec!r} is not one of auto | {' | '.join(PRECISIONS)}"


@dataclass
class InferenceConfig:
    """inference_server: the gRPC front over an engine pool."""

    host: str = f("127.0.0.1", "bind address (loopback by default)")
    port: int = f(0, lo=0, hi=65535, help="gRPC port; 0 = pick a free one")
    engine: str = f("local", "local (embedded torch engine) | sglang (SGLang servers over HTTP)",
                    choices=("local", "sglang"))
    sglang_urls: list = f([], "SGLang base URLs for engine=sglang")
    max_batch: int = f(256, lo=1, help="most sequences decoded together in one step")
    max_queue: int = f(4096, "waiting requests beyond this answer RESOURCE_EXHAUSTED", lo=1)
    max_context: int = f(1024, lo=1, help="longest prompt + output; longer prompts answer INVALID_ARGUMENT. engine=sglang: "
                                         "SGLang's context length, of which prompt + output may take all but 6 tokens")
    image_threads: int = f(2, "threads that prepare the images of requests (decode, resize, the image processor) off "
                              "the gRPC event loop (inference_server/image_prep.py)", lo=1)
    image_queue: int = f(64, "requests with images waiting for or in preparation beyond this answer RESOURCE_EXHAUSTED",
                         lo=1)
    threads: int = f(1, "torch intra-op threads of the local engine", lo=1)
    device: str = f("auto", "where the local engine runs its model and samples: auto (cuda when available, else cpu) | "
                            "cpu | cuda | cuda:N; cuda on a machine without CUDA is refused at start (exit 2)")
    precision: str = f("auto", "the dtype of the local engine's weights: auto (bf16 on CUDA, fp16 on a GPU without "
                               "bf16; fp32 on the CPU) | fp32 | bf16 | fp16. The behaviour logprobs come from this "
                               "precision; the learner's behaviour weight absorbs the gap to its own (docs/learner.md)")
    cache_capacity: int = f(4096, "trajectories whose KV prefix is kept (LRU)", lo=0)
    max_stale_versions: int = f(0, "default staleness budget for keeping KV across a weight update (0 = recompute)", lo=0)
    auth_token: str = f("", "if set, every RPC must carry `authorization: Bearer <token>` (its ControlService: "
                            "control.auth_token); required off loopback (the server refuses to start, exit 2); "
                            "`tars up` makes one per run when empty")
    auth_token_file: str = f("", "read inference.auth_token from this file (a Kubernetes Secret volume, a systemd "
                                 "credential), so it never sits on a command line")
    cache_max_bytes: int = f(0, "memory bound of the per-trajectory KV prefix cache, in bytes; 0 = auto: a tenth of the "
                                "memory available at start (MemAvailable, or free GPU memory for a CUDA model), at most 4 GiB", lo=0)
    cache_block_tokens: int = f(32, "the prefix cache holds KV in blocks of this many tokens; over the byte bound the least "
                                    "recently used trajectory loses its tail blocks first", lo=1)
    prefill_batch_tokens: int = f(8192, "most padded prompt tokens prefilled in one forward (bounds decode stalls)", lo=1)
    max_message_bytes: int = f(512 << 20, "largest gRPC message accepted (inline weights in UpdateWeights)", lo=1)
    update_timeout_s: float = f(120.0, "longest wait for a weight update to be applied between two steps", gt=0)
    max_version_jump: int = f(1000, "UpdateWeights to a version more than this beyond the one served is refused "
                              "(INVALID_ARGUMENT; a huge version would lock out every later publish); 0 = unbounded. "
                              "A server started from older weights than the learner's: start it with --version", lo=0)
    weights_root: str = f("", "if set, UpdateWeights paths (and the update_weights command's) must lie under this "
                              "directory, symlinks resolved (INVALID_ARGUMENT otherwise); `tars up` sets the run's weights/")
    sglang_pause_mode: str = f("abort", "engine=sglang: pause_generation mode around a weight update: abort (in-flight requests "
                               "come back and are resumed from their tokens) | retract | in_place (the server keeps them "
                               "and their KV from the old weights: tokens after the update are conditioned on it)",
                               choices=("abort", "retract", "in_place"))
    sglang_tp_size: int = f(1, "engine=sglang: tensor-parallel size of each server (--tp-size): in-memory weight updates "
                               "(update_weights_from_tensor) send one serialized entry per TP rank", lo=1)
    sglang_request_timeout_s: float = f(600.0, "engine=sglang: longest a generation may take, resumes included", gt=0)
    sglang_health_interval_s: float = f(2.0, "engine=sglang: seconds between GET /health_generate rounds", gt=0)
    sglang_health_timeout_s: float = f(25.0, "engine=sglang: health check timeout (SGLang's own check waits up to 20 s)", gt=0)
    sglang_health_failures: int = f(1, "engine=sglang: failed health checks in a row that take a replica out", lo=1)
    sglang_max_resumes: int = f(32, "engine=sglang: aborts / replica failures one request survives before it fails", lo=0)
    sglang_max_concurrency: int = f(256, "engine=sglang: HTTP calls in flight at once (threads of the client pool)", lo=1)
    sglang_launch: int = f(0, "engine=sglang: start and supervise this many SGLang servers on the --model directory "
                           "(restarted when one dies, stopped with the server); 0 = attach to sglang_urls (docs/sglang.md)",
                           lo=0)
    sglang_gpus: list = f([], "engine=sglang with sglang_launch: CUDA_VISIBLE_DEVICES of each launched server, round-robin "
                          "(e.g. [\"0\", \"1\"] or [\"0,1\"] for --tp-size 2); empty = inherit")
    sglang_host: str = f("127.0.0.1", "engine=sglang with sglang_launch: the launched servers' bind address, loopback "
                         "only (their HTTP API takes no token; another address is refused before launch)")
    sglang_base_port: int = f(30000, "engine=sglang with sglang_launch: server i listens on sglang_base_port + i",
                              lo=1, hi=65535)
    sglang_args: list = f([], "engine=sglang with sglang_launch: extra SGLang server flags, e.g. [--mem-fraction-static, "
                          "'0.85', --tp-size, '2']")
    sglang_python: str = f("", "engine=sglang with sglang_launch: the Python that runs SGLang (its own environment: "
                           "SGLang 0.5.23 pins another torch than tars); empty = this interpreter")
    sglang_module: str = f("sglang.launch_server", "engine=sglang with sglang_launch: the module run as `python -m` "
                           "(inference_server.sglang_conformance is the stand-in the tests use)")
    sglang_startup_timeout_s: float = f(900.0, "engine=sglang: at start, how long to wait for a first server to answer "
                                        "GET /health_generate (model load included) before exiting with status 2", gt=0)
    sglang_max_restarts: int = f(5, "engine=sglang with sglang_launch: restarts of one server that died before it is "
                                 "given up (its replica stays out)", lo=0)
    sglang_restart_backoff_s: float = f(2.0, "engine=sglang with sglang_launch: wait before a restart, doubled for each "
                                        "restart of the same server (at most 60 s)", lo=0)
    sticky_max_imbalance: int = f(8, "a trajectory leaves its replica (and its prefix cache) when that replica has more than "
                                  "this many requests in flight beyond the least loaded one; 0 = always sticky", lo=0)

    def request_limit(self) -> int:
        """The longest prompt + max_new_tokens the engine serves in full: max_context; with engine=sglang (whose
        context length max_context is taken to be) SGLANG_CONTEXT_MARGIN less, as SGLang refuses a request that reaches
        its context length, a prompt within 6 tokens of it, and ends a generation 2 tokens short of it. The front, the engines and the actors check against this."""
        return self.max_context - (SGLANG_CONTEXT_MARGIN if self.engine == "sglang" else 0)

    def config_error(self) -> str:
        """What is wrong with device / precision / the launched servers' ports ("" when nothing): the config loader raises it as a ConfigError.
        Whether CUDA is there is checked where the engine starts (core.device.resolve_device)."""
        if self.sglang_launch and self.sglang_base_port + self.sglang_launch - 1 > 65535:
            return (f"inference.sglang_base_port={self.sglang_base_port} with sglang_launch={self.sglang_launch}: the "
                    f"last server's port {self.sglang_base_port + self.sglang_launch - 1} is past 65535")
        return device_error(self.device, "inference.device") or precision_error(self.precision, "inference.precision")
