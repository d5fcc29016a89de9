"""Typed configuration: one dataclass per role, help text on every field, YAML presets, `--set a.b=c` overrides.

The resolved config is written into every run directory (config.yaml) so a run can be reproduced. A section may
hold sections (`learner.staleness.eta`; the learner's are in core/config_learner.py); a class's MOVED table maps
keys of an older layout to their new place, so such a key is refused with an error that names it. Values are read
into their fields' types, `--set` text and YAML alike, by core/config_values.py. `validate` checks the rules that
span sections.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
from dataclasses import dataclass, field
from typing import ClassVar

import yaml

from core.config_fields import f
from core.config_values import EXIT_USER, ConfigError, UserError, apply_override, from_dict, load_yaml  # noqa: F401
from core.config_inference import InferenceConfig  # noqa: F401 (core.config.InferenceConfig)
from core.config_learner import (CheckpointConfig, CorrectionConfig, GroupConfig, LearnerConfig,  # noqa: F401
                                 PPOConfig, PublishConfig, StalenessConfig, StreamConfig, ValuePretrainConfig)

PRESETS = pathlib.Path(__file__).parent / "presets"
# Episode seeds are split in two: everything that trains (actors, SFT demonstrations, a fresh tokenizer's corpus)
# draws its env seeds below HELD_OUT_SEED_BASE, and a held-out evaluation (a suite with `held_out: true`, the
# evaluation at the end of `tars up`) uses seeds at or above it, so no training episode ever had a held-out seed.
HELD_OUT_SEED_BASE = 1 << 30
SEED_LO, SEED_HI = -(1 << 63), (1 << 64) - 1  # what torch.manual_seed takes (past it: "Overflow when unpacking long")


@dataclass
class ModelConfig:
    """The policy network: a Qwen2-style decoder created from scratch or loaded from an HF directory."""

    path: str = f("", "Hugging Face checkpoint directory to start from (config.json, safetensors, tokenizer with a chat "
                      "template; Qwen2/Qwen2.5 or Llama: docs/model.md); empty = a fresh tiny model (tars/fresh.py)")
    hidden_size: int = f(64, lo=1, help="width of a fresh model")
    intermediate_size: int = f(256, "MLP width of a fresh model", lo=1)
    num_layers: int = f(2, lo=1, help="decoder layers of a fresh model")
    num_heads: int = f(4, lo=1, help="attention heads of a fresh model")
    num_kv_heads: int = f(4, lo=1, help="key/value heads of a fresh model (GQA when fewer than num_heads)")
    max_positions: int = f(1024, lo=1, help="context length")
    rope_theta: float = f(100.0, "RoPE base of a fresh model; a small base separates nearby positions sharply, "
                                 "which short GUI prompts need more than long-range reach", gt=0)
    vocab_size: int = f(1024, lo=1, help="BPE vocabulary of a fresh model's tokenizer, trained on the tasks' text (tars/fresh.py); "
                              "the trainer stops earlier when the text has no more pairs to merge")
    tie_embeddings: bool = f(False, "share the input embedding and the output projection of a fresh model")
    init_std: float = f(0.02, "init scale of a fresh model", lo=0)
    seed: int = f(0, "init seed of a fresh model", lo=SEED_LO, hi=SEED_HI)
    freeze_vision: bool = f(False, "a vision-language checkpoint (Qwen2-VL / Qwen2.5-VL): keep its vision tower's weights "
                                   "fixed (no gradient, not in the optimiser); false = the learner and tars sft train "
                                   "it with the language model")


@dataclass
class EnvdConfig:
    """envd: the environment daemon."""

    host: str = f("127.0.0.1", "bind address (loopback by default)")
    port: int = f(0, lo=0, hi=65535, help="gRPC port; 0 = pick a free one")
    max_sessions: int = f(4096, "session cap; CreateSession beyond it answers RESOURCE_EXHAUSTED", lo=1)
    max_sessions_per_client: int = f(1024, "sessions one client (its gRPC peer address: the IP without the port, since "
                                           "the shared auth token names nobody and a request's client_id is whatever "
                                           "the caller writes) may hold; CreateSession/Fork/Restore beyond it answer "
                                           "RESOURCE_EXHAUSTED; 0 = no per-client cap", lo=0)
    max_total_pids: int = f(0, "host-wide budget of processes (threads included) that all sessions together may be "
                               "allowed: the sum of their sandboxes' nproc (estimates for backends without a sandbox); "
                               "a session past it answers RESOURCE_EXHAUSTED; 0 = half of the host's pid/thread limit", lo=0)
    max_total_memory_mb: int = f(0, "host-wide budget of memory (MiB) that all sessions together may be allowed: the sum "
                                    "of their sandboxes' memory_mb plus tmpfs sizes (estimates for backends without a "
                                    "sandbox); past it RESOURCE_EXHAUSTED; 0 = 3/4 of the host's physical memory", lo=0)
    max_total_disk_mb: int = f(0, "host-wide budget of disk (MiB) that all sessions together may be allowed: the sum "
                                  "of their sandboxes' workspace quotas disk_mb plus fsize_mb (estimates for backends "
                                  "without a sandbox); past it RESOURCE_EXHAUSTED; 0 = 3/4 of the space free at start "
                                  "on the file system of the temp dir, which holds every session's files", lo=0)
    memory_cgroups: str = f("auto", "a memory cgroup per sandbox, bounding all of its processes together (envd/cgroups.py): "
                                    "auto (where this daemon may make cgroups: root, or a delegated cgroup) | required "
                                    "(refuse to start without) | off", choices=("auto", "required", "off"))
    lease_ttl_s: float = f(60.0, "default session lease; renewed by every step and heartbeat", gt=0)
    gc_interval_s: float = f(1.0, "how often expired leases are collected", gt=0)
    workers: int = f(8, lo=1, help="threads for blocking backends")
    max_message_bytes: int = f(16 << 20, "largest gRPC message accepted", lo=1)
    auth_token: str = f("", "if set, every RPC must carry `authorization: Bearer <token>` (its ControlService: "
                            "control.auth_token); required off loopback (envd refuses to start, exit 2); `tars up` "
                            "makes one per run when empty")
    auth_token_file: str = f("", "read envd.auth_token from this file (a Kubernetes Secret volume, a systemd "
                                 "credential: %d/envd-token), so it never sits on a command line")
    snapshot_key: str = f("", "signs the snapshots Snapshot hands out; Restore refuses one it does not match "
                              "(envd/snapshots.py). Empty: a random key per daemon process (a snapshot restores on "
                              "the daemon that made it); the same key on several daemons lets them restore each other's")
    snapshot_key_file: str = f("", "read envd.snapshot_key from this file")
    step_timeout_s: float = f(60.0, "deadline of one blocking backend call (create, reset, step, ...); past it the "
                                    "session ends as INFRA_ERROR", gt=0)
    shutdown_grace_s: float = f(2.0, "on SIGTERM, how long in-flight RPCs may finish before envs are closed", lo=0)
    latency_window: int = f(4096, "recent steps kept for the step latency p50/p99 in ControlService status", lo=1)
    unsandboxed_envs: bool = f(False, "deprecated, ignored (a warning in envd's log when true): desktop and hybrid are "
                                      "always served now, since their GUI apps run in the terminal's sandbox")


# SGLang's rule (_SAMPLING_EPS): a sampling temperature under it is greedy, as 0 is. The engines sample so, and the
# learner reads such a policy's logprobs at temperature 1 (learner/ppo.py).
GREEDY_BELOW = 1e-6


@dataclass
class ActorConfig:
    """actor: asyncio episode runners."""

    concurrency: int = f(64, lo=1, help="episodes run at once by one actor process")
    env_ids: list = f(["builtin/mixed"], "env ids to sample episodes from (uniformly)")
    env_options: dict = f({}, "options passed to CreateSession; `screenshots` is set to 0 unless given when nothing of "
                              "an episode reads one (image_history 0 and judge_mode off: docs/actor.md)")
    chat_template_kwargs: dict = f({}, "extra variables for the checkpoint's chat template, in every prompt the actor, "
                                   "tars sft's demonstrations and tars eval build: e.g. {enable_thinking: false} for "
                                   "Qwen3 (its generation prompt then closes an empty think block)")
    keep_sessions: int = f(0, lo=0, help="idle envd sessions one actor keeps for reuse: the next episode of the same env id "
                                  "and options resets one with its seed instead of creating a session (for a browser "
                                  "that saves its start, ~1 s of CPU for MiniWoB's Chromium); a session whose episode "
                                  "failed is never reused; 0 = every episode creates and closes its own (actor/envclient.py)")
    max_turns: int = f(6, lo=1, help="step budget per episode; beyond it the episode is truncated")
    max_new_tokens: int = f(16, lo=1, help="generation budget per turn")
    max_obs_tokens: int = f(1024, lo=0, help="token budget of one observation's text in the prompt: a longer one is clipped, with a "
                                  "visible '[observation clipped ...]' marker (docs/actor.md); 0 = no budget")
    temperature: float = f(1.0, lo=0, help="sampling temperature")
    format_penalty: float = f(-0.1, "reward added to a turn whose output does not parse")
    on_parse_error: str = f("continue", "continue (tell the model and go on) | stop (truncate the episode)",
                            choices=("continue", "stop"))
    on_context_full: str = f("window", "a turn whose prompt would not fit the context: window (start a new segment, "
                                       "a first prompt with the earlier turns' actions as text and only the new "
                                       "observation; actor/episode.py) | truncate (end the episode there)",
                            choices=("window", "truncate"))
    rpc_timeout_s: float = f(30.0, "deadline of every envd / inference call", gt=0)
    retries: int = f(3, lo=0, help="retries with exponential backoff for retryable RPC failures")
    coalesce_generate: bool = f(True, "inference calls made together go as one GenerateBatch call per replica, each "
                                      "keeping its own result, deadline and retries (core/inference_client.py); "
                                      "false = one Generate call each")
    unavailable_retry_s: float = f(60.0, "how long an inference call keeps retrying a server that is down (e.g. "
                                         "restarting) before the episode ends as infra_error; the rollout resumes", lo=0)
    episode_attempts: int = f(3, lo=1, help="attempts per episode: an infra_error episode is rerun from scratch on a live envd "
                                 "(the failed attempt is never sent); the last one is sent as infra_error. One whose "
                                 "inference stayed down past unavailable_retry_s is sent at once (fault inference)")
    admission_timeout_s: float = f(120.0, "longest wait for the learner to admit a new episode", gt=0)
    send_window: int = f(256, lo=1, help="trajectories sent and not yet acknowledged (or held by the learner) before sending waits")
    max_outbox: int = f(1 << 16, "trajectories kept for re-send until acknowledged, held ones included (with the learner's "
                        "checkpoint durability: everything since its last checkpoint); sending waits at this bound", lo=1)
    stream_curve_public_key: str = f("", "this actor's Z85 CURVE public key on the trajectory stream, listed in the "
                                         "learner's learner.stream.curve_client_keys; empty: a fresh keypair per "
                                         "process, which a learner with an allowlist refuses")
    stream_curve_secret_key: str = f("", "this actor's Z85 CURVE secret key (zmq.curve_keypair() makes a pair)")
    stream_curve_public_key_file: str = f("", "read actor.stream_curve_public_key from this file")
    stream_curve_secret_key_file: str = f("", "read actor.stream_curve_secret_key from this file")
    system_prompt: str = f("auto", "system prompt of the first turn: auto (a vision-language checkpoint on a GUI task: "
                                   "computer; otherwise tiny) | tiny (one line, for small policies trained from "
                                   "scratch) | computer | browser | mobile (the UI-TARS prompts, actor/prompts.py) | none",
                           choices=("auto", "tiny", "none", "computer", "browser", "mobile"))
    image_history: int = f(-1, "screenshots shown as images in the prompt; -1 = auto (5 for a vision-language "
                               "checkpoint, else 0). VL: at most k images per segment, the (k+1)-th starts a new one "
                               "(docs/actor.md); tars_vision: the last k turns; 0 = text only", lo=-1)
    image_tokens: int = f(16, "image placeholder tokens per screenshot: the model's tars_vision grid**2 (a "
                              "vision-language checkpoint counts its own from each screenshot's size)", lo=0)
    coordinates: str = f("auto", "what the model's coordinates mean: auto (relative for a Qwen2-VL checkpoint, absolute "
                                 "for a Qwen2.5-VL one, else screen) | absolute (UI-TARS-1.5: pixels of the resized screenshot) | relative "
                                 "(UI-TARS-1.0: 0..1000) | screen (screen pixels, passed to envd as they are)",
                         choices=("auto", "absolute", "relative", "screen"))
    judge_mode: str = f("off", "LLM-as-judge outcome reward through the inference server: off | replace (the verdict "
                               "replaces the env reward) | add (added to it)", choices=("off", "replace", "add"))
    judge_weight: float = f(1.0, "reward given for a YES (score 1) verdict")
    judge_images: int = f(5, "last screenshots shown to the judge", lo=0)
    judge_max_new_tokens: int = f(8, "generation budget of the judge's answer", lo=1)
    judge_on_error: str = f("infra_error", "unparseable verdict or judge call failed: infra_error (episode kept out "
                                           "of the loss) | env (keep the env reward)", choices=("infra_error", "env"))
    judge_model: str = f("", "the judge's own checkpoint directory (HF layout), frozen: its tokenizer and chat "
                             "template write the judge's prompts, and `tars up` serves it on an inference server of "
                             "its own that the learner never updates; empty: the policy judges itself (docs/actor.md)")
    judge_inference: str = f("", "host:port[,host:port...] of inference servers already serving the judge "
                                 "(actor.judge_model's tokenizer, else the policy's); empty: the policy's servers, or "
                                 "the one `tars up` starts for actor.judge_model")

    # The group size is the learner's (learner.group.size): one number for the actors that launch the members and
    # the learner that waits for them.
    MOVED: ClassVar[dict[str, str]] = {"group_size": "learner.group.size"}

    @property
    def unserved_judge(self) -> bool:
        """A judge of its own (judge_model) with no servers given (judge_inference), while the judge is on: `tars up`
        serves it; anything else that would ask it refuses, or (tars eval) does not judge."""
        return self.judge_mode != "off" and bool(self.judge_model) and not self.judge_inference


@dataclass
class SFTConfig:
    """Warm start by supervised fine-tuning on scripted demonstrations, inside `tars up`."""

    steps: int = f(0, lo=0, help="SFT updates; 0 = no warm start")
    batch_size: int = f(32, lo=1, help="demonstration turns per update")
    lr: float = f(3e-3, lo=0, help="SFT learning rate")
    episodes: int = f(0, lo=0, help="demonstration episodes to roll; 0 = max(2000, 4 x steps)")
    val_episodes: int = f(0, lo=0, help="demonstration episodes on pages of their own (another stream of training "
                                        "seeds), measured every 50 steps: loss and the mean probability of each "
                                        "demonstrated answer, in the log and sft.json \"val\"; 0 = none")
    demonstrator: str = f("noisy:0.2", "oracle | noisy:P (oracle with probability P, else a random visible widget) | "
                          "confused:P (oracle with probability P, else its kind of action with a random word of the goal) | "
                          "confused:P:N (the same, drawing from the goal's words and N plausible distractors: a visible "
                          "label, a name to type)")


@dataclass
class TelemetryConfig:
    """OpenTelemetry traces and metrics of every process (docs/telemetry.md)."""

    enabled: bool = f(True, "trace and meter this process; false = no spans, no metrics, near-zero cost")
    exporter: str = f("", "where spans go: otlp-grpc | otlp-http (the official OpenTelemetry OTLP exporters; they "
                          "honour every OTEL_EXPORTER_OTLP_* variable) | console (stdout) | file (span files in dir) | "
                          "none; empty = $OTEL_TRACES_EXPORTER (otlp, console, none), else OTLP when an endpoint is "
                          "set, else the span file when dir is known, else none")
    dir: str = f("", "span files (spans-<role>-<pid>.jsonl) go here (exporter=file, or auto with no OTLP endpoint); "
                     "`tars up` uses <out>/telemetry; empty with no endpoint = no spans")
    otlp_endpoint: str = f("", "OTLP endpoint: base URL for otlp-http (e.g. http://otel-collector:4318; /v1/traces is "
                               "added), host URL for otlp-grpc (e.g. http://otel-collector:4317; http:// = no TLS); "
                               "set = wins over $OTEL_EXPORTER_OTLP_ENDPOINT, empty = that variable (or "
                               "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is used")
    otlp_protocol: str = f("", "OTLP protocol when exporter is auto: grpc | http/protobuf (http/json is sent as "
                               "http/protobuf); empty = $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, "
                               "$OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf")
    sample_ratio: float = f(0.1, lo=0, hi=1, help="share of episodes traced (their turns, env steps and generations follow the "
                                 "episode); learner steps are always traced")
    max_queued_spans: int = f(8192, "spans waiting for export; past it the oldest are dropped, never waited for", lo=1)
    max_file_mb: float = f(256.0, "a span file stops growing past this size (spans then counted as dropped)", lo=0)
    max_attribute_length: int = f(4096, "characters kept of one string attribute of a span, event or link (the SDK "
                                        "truncates longer values: a caller-sent id cannot grow spans without bound)",
                                  lo=1)
    prometheus_port: int = f(-1, "serve Prometheus text (prometheus_client) at http://HOST:PORT/metrics (HOST = "
                                 "prometheus_host); 0 = any free port (named in the run file, shown by `tars ctl "
                                 "status`); -1 = off. Under `accelerate launch` the process with LOCAL_RANK n > 0 "
                                 "serves PORT + n; under `tars up` each role gets its own, PORT, PORT+1, ... in the "
                                 "order envd, inference, actor0.., learner")
    prometheus_host: str = f("127.0.0.1", "address the /metrics listener binds: 127.0.0.1 keeps it on this machine; "
                                          "0.0.0.0 (a pod) or a private address lets a Prometheus elsewhere scrape "
                                          "it, and then needs prometheus_token (or prometheus_allow_no_token)")
    prometheus_token: str = f("", "if set, a scrape must carry `Authorization: Bearer <token>` (Prometheus: "
                                  "authorization.credentials_file); without it: 401 and no metrics. Required off "
                                  "loopback (the role refuses to start, exit 2) unless prometheus_allow_no_token; "
                                  "`tars up` makes one per run when empty")
    prometheus_token_file: str = f("", "read telemetry.prometheus_token from this file (a Kubernetes Secret volume, a "
                                       "systemd credential: %d/metrics-token), the file Prometheus reads it from too")
    prometheus_allow_no_token: bool = f(False, "serve /metrics off loopback without prometheus_token: only where "
                                               "a firewall or NetworkPolicy admits the Prometheus server alone "
                                               "(docs/threat-model.md)")


@dataclass
class ControlConfig:
    """control: the ControlService every process serves (status, pause, drain, set eta, checkpoint; `tars ctl`)."""

    auth_token: str = f("", "protects every process's ControlService (envd, inference, actors, learner): if set, every "
                            "control RPC must carry `authorization: Bearer <token>`, and `tars ctl` sends it. Required "
                            "when envd.auth_token or inference.auth_token is set (their ControlService shares the "
                            "listener); `tars up` makes one per run when empty, apart from the service tokens")
    auth_token_file: str = f("", "read control.auth_token from this file (a Kubernetes Secret volume, a systemd "
                                 "credential; `tars ctl` reads it too)")


@dataclass
class EvaluationConfig:
    """The held-out evaluation at the end of `tars up` (tars/heldout.py): the warm start and the final policy on the
    run's tasks, with seeds no training episode drew, the same seeds for both."""

    episodes: int = f(0, lo=0, help="episodes per task for each of the two policies; 0 = no held-out evaluation")
    concurrency: int = f(4, lo=1, help="episodes at once")
    temperature: float = f(-1.0, "sampling temperature of both policies; -1 = actor.temperature (as trained)", lo=-1)


@dataclass
class SupervisorConfig:
    """supervisor: what `tars up` does when one of its processes dies (tars/supervisor.py)."""

    max_restarts: int = f(5, lo=0, help="restarts of one process (envd, inference, the learner, each actor) before the run "
                             "ends; 0 = a death ends the run (an exit with status 2, a user error, always does)")
    backoff_s: float = f(1.0, "wait before the first restart; doubled for each further death of that process, "
                              "at most 30 s", lo=0)
    hang_s: float = f(120.0, lo=0, help="a process that is up but has not answered a ControlService Status for this "
                                      "long (stopped, deadlocked) is killed and restarted; 0 = not probed")


@dataclass
class RunConfig:
    """A whole `tars up` run."""

    name: str = f("run", "a name for logs")
    seed: int = f(0, "global seed", lo=SEED_LO, hi=SEED_HI)
    max_versions: int = f(1000, lo=0, help="stop after this many policy updates")
    wall_budget_s: float = f(480.0, lo=0, help="stop RL after this many seconds")
    target_success: float = f(0.0, lo=0, hi=1, help="stop early once the rolling success rate reaches this (0 = never)")
    actors: int = f(1, lo=1, help="actor processes")
    model: ModelConfig = field(default_factory=ModelConfig)
    envd: EnvdConfig = field(default_factory=EnvdConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig,
                                         metadata={"help": "held-out evaluation at the end of `tars up`"})
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig,
                                       metadata={"help": "traces, metrics and their exporters (docs/telemetry.md)"})
    control: ControlConfig = field(default_factory=ControlConfig,
                                   metadata={"help": "the ControlService of every process and `tars ctl`"})
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig,
                                         metadata={"help": "restarts of the processes of `tars up`"})


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def load(preset: str | None = None, path: str | None = None, overrides: list[str] = ()) -> RunConfig:
    """Preset (by name) or YAML file, then `key=value` overrides, into a checked RunConfig."""
    d: dict = {}
    if preset:
        p = PRESETS / f"{preset}.yaml"
        if not p.exists():
            raise ConfigError(f"no preset {preset!r}; have: {sorted(x.stem for x in PRESETS.glob('*.yaml'))}")
        d = load_yaml(p.read_text()) or {}
    if path:
        d = _merge(d, _read_yaml(pathlib.Path(path)))
    for o in overrides:
        if "=" not in o:
            raise ConfigError(f"override {o!r} is not key=value")
        k, v = o.split("=", 1)
        apply_override(d, k.strip(), v)
    cfg = from_dict(RunConfig, d)
    from core.auth import SecretFileError, read_secret_files

    try:
        read_secret_files(cfg)  # every X_file field into X (envd.auth_token_file, ...)
    except SecretFileError as e:
        raise ConfigError(str(e)) from None
    validate(cfg)
    return cfg


def validate(cfg: RunConfig) -> None:
    """Rules that span sections (ConfigError)."""
    t = cfg.telemetry
    if t.exporter.strip().lower() not in ("", "otlp-grpc", "otlp-http", "console", "file", "none"):
        raise ConfigError(f"telemetry.exporter={t.exporter!r}: one of otlp-grpc, otlp-http, console, file, none "
                          "(empty = auto)")
    if t.otlp_protocol.strip().lower() not in ("", "grpc", "http/protobuf", "http/json"):
        raise ConfigError(f"telemetry.otlp_protocol={t.otlp_protocol!r}: one of grpc, http/protobuf (empty = "
                          "$OTEL_EXPORTER_OTLP_PROTOCOL)")
    if not -1 <= t.prometheus_port <= 65535:
        raise ConfigError(f"telemetry.prometheus_port={t.prometheus_port}: a TCP port (0 = any free port, -1 = off)")
    if t.prometheus_port >= 0 and not t.prometheus_host.strip():
        raise ConfigError("telemetry.prometheus_host is empty: an address to bind (127.0.0.1, 0.0.0.0, ...)")
    if (cfg.envd.auth_token or cfg.inference.auth_token) and not cfg.control.auth_token:
        # envd's and the inference server's ControlService (drain, kill sessions, status) share their listener:
        # a service token alone would leave those commands open.
        raise ConfigError("envd.auth_token / inference.auth_token is set but control.auth_token is empty: the "
                          "ControlService on the same listeners would take unauthenticated calls; set control.auth_token")
    from core.auth import secrets_error

    if err := secrets_error(cfg):
        raise ConfigError(err)
    if cfg.actor.max_outbox < cfg.actor.send_window:  # the sender refuses it when the actor starts (ValueError)
        raise ConfigError(f"actor.max_outbox={cfg.actor.max_outbox} is below actor.send_window={cfg.actor.send_window}: "
                          "the outbox holds every trajectory in the send window")
    if cfg.actor.concurrency < cfg.learner.group.size:  # actor/main.py starts whole groups: it would never start one
        raise ConfigError(f"actor.concurrency={cfg.actor.concurrency} is below learner.group.size="
                          f"{cfg.learner.group.size}: an actor runs whole GRPO groups at once, so it would never start "
                          "an episode")
    if -1 < cfg.evaluation.temperature < 0:  # tars/heldout.py: any value below 0 fell back to actor.temperature
        raise ConfigError(f"evaluation.temperature={cfg.evaluation.temperature}: a sampling temperature >= 0, or -1 "
                          "for actor.temperature")
    if "hint_policy" in cfg.actor.env_options:  # envd/hints.py's option (core does not import envd)
        raise ConfigError("actor.env_options.hint_policy: the scripted baselines' hints are for `tars eval --model "
                          "oracle|random`; a run's sessions never carry one (a demonstrator must not play during RL)")
    if err := cfg.learner.config_error() or cfg.inference.config_error():
        raise ConfigError(err)


def _read_yaml(p: pathlib.Path) -> dict:
    """A --config file as a mapping; ConfigError when it is missing, unreadable or not a YAML mapping."""
    if not p.is_file():
        raise ConfigError(f"--config {str(p)!r}: " + ("a directory, not a YAML file" if p.is_dir() else "no such file"))
    try:
        d = load_yaml(p.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"--config {str(p)!r}: cannot be read as YAML: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if d is not None and not isinstance(d, dict):
        raise ConfigError(f"--config {str(p)!r}: expected a mapping of sections (model:, actor:, ...), got {type(d).__name__}")
    return d or {}


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def save(cfg, path: str | pathlib.Path) -> None:
    """Write cfg as YAML, readable by its owner only (0600: it may hold tokens and keys), atomically."""
    p = pathlib.Path(path)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def help_text(cls=RunConfig, prefix: str = "") -> str:
    """Every field with its default and help, a section's fields under a `[section]` heading with its docstring."""
    lines = []
    for fl in dataclasses.fields(cls):
        if dataclasses.is_dataclass(fl.default_factory() if fl.default_factory is not dataclasses.MISSING else None):
            sub = type(fl.default_factory())
            doc = (sub.__doc__ or "").strip().split("\n")[0]
            head, _, rest = doc.partition(": ")
            doc = rest if head in (fl.name, prefix + fl.name) else doc  # "learner.ppo: the loss" -> "the loss"
            lines.append(f"[{prefix}{fl.name}] {doc}")
            lines.append(help_text(sub, prefix + fl.name + "."))
        else:
            default = fl.default if fl.default is not dataclasses.MISSING else fl.default_factory()
            lo, hi = fl.metadata.get("lo"), fl.metadata.get("hi")
            rng = "" if lo is None and hi is None else (f" {'(' if fl.metadata.get('lo_open') else '['}"
                                                        f"{'' if lo is None else lo}..{'' if hi is None else hi}]")
            lines.append(f"  {prefix}{fl.name} = {default!r}{rng}\n      {fl.metadata.get('help', '')}")
    return "\n".join(lines)
