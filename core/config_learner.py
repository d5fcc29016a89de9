"""The learner's configuration (`learner.*`), in sections: what a field tunes decides where it lives.

Top level: what every update needs (algo, batch size, optimiser, device). Sections: `ppo` (the loss), `correction`
(how the loss corrects for tokens older weights generated), `staleness` (how off-policy a batch may be), `group`
(GRPO groups), `value_pretrain`, `checkpoint`, `publish` (weights to the inference servers) and `stream` (the
trajectory stream the actors send to).

The keys were flat before (`learner.eta`); MOVED maps every old key to its new place, so an old YAML file or
`--set learner.eta=4` fails with a ConfigError that names the new key instead of a bare "unknown key".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from core.config_fields import f


@dataclass
class PPOConfig:
    """learner.ppo: the policy loss (decoupled PPO; GRPO uses the clip, KL and entropy terms too)."""

    eps_low: float = f(0.2, "PPO clip, lower side", lo=0)
    eps_high: float = f(0.28, "PPO clip, upper side (clip-higher)", lo=0)
    behav_cap: float = f(5.0, "cap of the decoupled behaviour weight pi_prox / pi_behav (learner.correction.kind="
                              "decoupled)", gt=0)
    gamma: float = f(1.0, "discount", lo=0, hi=1)
    lam_policy: float = f(0.95, "GAE lambda for advantages (unused under learner.correction.kind=vtrace)", lo=0, hi=1)
    lam_critic: float = f(1.0, "GAE lambda for value targets (decoupled GAE; unused under vtrace)", lo=0, hi=1)
    length_adaptive: bool = f(False, "lambda_policy = 1 - 1/(alpha * response length) (VAPO)")
    length_alpha: float = f(0.05, "alpha of length-adaptive GAE", lo=0)
    value_clip: float = f(0.2, "clip range of the value loss", lo=0)
    epochs: int = f(1, "passes over each batch", lo=1)
    minibatches: int = f(1, "minibatches per pass", lo=1)
    adv_norm: bool = f(True, "normalise advantages over the batch's generated tokens")
    neg_adv_weight: float = f(1.0, "scale of negative advantages (1 = symmetric PPO); below 1, updates away from failed "
                                   "samples are tempered, which keeps the shared output-format tokens stable at learning "
                                   "rates where symmetric updates break them (asymmetric REINFORCE)", lo=0)
    entropy_coef: float = f(0.0, "entropy bonus (the starting value when target_entropy is set)", lo=0)
    target_entropy: float = f(0.0, "adaptive entropy control: above 0, the entropy bonus's coefficient is raised while "
                                   "the mean entropy of generated tokens is below this and lowered (not below 0) while "
                                   "above it, so the policy keeps exploring instead of collapsing onto its first habits")
    entropy_coef_lr: float = f(0.002, "step of the adaptive coefficient per update, per nat of entropy off target", lo=0)
    entropy_coef_max: float = f(0.02, "upper bound of the adaptive entropy coefficient", lo=0)
    kl_coef: float = f(0.0, "penalty on the KL (k3 estimator) from the initial (warm-started) policy on generated "
                            "tokens; anchors the output format at higher learning rates", lo=0)
    truncated_value: float = f(0.0, "without a critic (algo=grpo), the value of the state a limit (actor.max_turns, the "
                                    "context) cut an episode in, added to its return: 0 scores a cut-off episode by its "
                                    "rewards so far. Set it to what the task gives a failure (MiniWoB: -1 for running "
                                    "out of time) where that is below 0; at 0 an episode that stalls until the limit "
                                    "scores above one that gives a wrong answer (docs/learner.md)")
    skip_zero_adv: bool = f(True, "rows whose advantage is 0 at every token (a GRPO group that all failed or all "
                                  "succeeded) skip the training forward and backward when no other loss term reads "
                                  "them (no critic, reference KL or entropy term): the same gradient for less compute; "
                                  "the update's entropy, clipfrac and importance figures are then over the rows trained")


@dataclass
class CorrectionConfig:
    """learner.correction: how the update corrects for tokens that older weights generated (docs/learner.md).

    The staleness bound (learner.staleness) decides which trajectories are trained on whatever the correction;
    the correction decides how the loss weighs them.
    """

    KINDS: ClassVar[tuple[str, ...]] = ("decoupled", "vtrace", "tis", "none")

    kind: str = f("decoupled", "decoupled: AReaL's decoupled PPO, clipped against pi_prox (the learner's weights before "
                               "the update) and weighted by min(pi_prox / pi_behav, learner.ppo.behav_cap) | vtrace: "
                               "IMPALA's V-trace targets for the critic and rho-weighted advantages for the policy, "
                               "clipped against pi_prox (needs algo=ppo) | tis: truncated importance sampling, no "
                               "proximal pass and no clip, each token's gradient weighted by min(pi_theta / pi_behav, "
                               "tis_cap) | none: plain PPO clipped against pi_behav, no proximal pass")
    rho_bar: float = f(1.0, "vtrace: truncation of the importance weight rho = min(rho_bar, pi_prox / pi_behav) in the "
                            "TD errors and the policy advantages (which value function V-trace converges to)", gt=0)
    c_bar: float = f(1.0, "vtrace: truncation of the trace coefficients c = min(c_bar, pi_prox / pi_behav) (how far "
                          "back a TD error is carried; c_bar <= rho_bar)", gt=0)
    tis_cap: float = f(2.0, "tis: cap C of the truncated importance ratio min(pi_theta / pi_behav, C)", gt=0)


@dataclass
class StalenessConfig:
    """learner.staleness: how far behind the current policy a trained trajectory may be."""

    eta: int = f(2, "staleness bound: started trajectories <= B * (version + 1 + eta); 0 = synchronous; live: "
                    "`tars ctl set eta N`", lo=0)
    max_lag: int = f(8, "trajectories whose oldest token is more versions behind than this are dropped", lo=0)


@dataclass
class GroupConfig:
    """learner.group: GRPO groups (episodes of one task seed), assembled whole before they are trained on."""

    size: int = f(1, "episodes per task seed; 1 = independent. The one source of truth: the actors launch this many "
                     "members per seed and the learner waits for all of them", lo=1)
    timeout_s: float = f(120.0, "a group still incomplete this long after its first member arrived is trained as it "
                                "is, so a lost actor cannot stall training", lo=0)


@dataclass
class ValuePretrainConfig:
    """learner.value_pretrain: critic-only updates (the policy fixed) before PPO starts."""

    steps: int = f(0, "critic-only updates before PPO starts; 0 = none", lo=0)
    target_ev: float = f(0.5, "stop early once the critic's explained variance, averaged over the last 10 batches, "
                              "reaches this")


@dataclass
class CheckpointConfig:
    """learner.checkpoint: model, optimizers, RNG, version and consumed trajectory ids in run_dir/ckpt."""

    every: int = f(20, "checkpoint every N updates (and at the end; `tars ctl checkpoint` asks for one now)", lo=1)


@dataclass
class PublishConfig:
    """learner.publish: each new version written to run_dir/weights/vNNNNNN and loaded by every inference server."""

    keep_versions: int = f(3, "published weight versions kept on disk", lo=1)
    timeout_s: float = f(60.0, "deadline of one inference server's UpdateWeights; a server past it is counted as a "
                               "publish failure (it loads the latest version when it restarts)", gt=0)
    mode: str = f("auto", "how weights reach the servers: shm (a segment in /dev/shm named over gRPC, same host "
                          "only), stream (UpdateWeightsStream chunks over gRPC), disk (weights/vN loaded by path); auto = "
                          "shm when every inference server is on loopback and /dev/shm is writable, else disk. In shm "
                          "and stream modes weights/vN is still written after the servers answered (restarts load it)")
    host_copy: bool = f(True, "with the policy on a GPU: keep one pinned host copy of the weights between publishes "
                              "and fill it with one device-to-host copy per version (measured on an H200 with 4.1 GB "
                              "of fp32 weights: 0.08 s against 2.8 s unpinned, paid twice before: the segment or stream "
                              "and the disk copy); costs the weights' size in host memory, allocated at the first "
                              "publish. false: copy to unpinned memory at each publish and free it after")
    MODES: ClassVar[tuple[str, ...]] = ("auto", "shm", "stream", "disk")


@dataclass
class StreamConfig:
    """learner.stream: the acked, credit-based ZMQ trajectory stream the actors send to."""

    host: str = f("127.0.0.1", "bind address of the trajectory stream")
    port: int = f(0, "ZMQ port of the trajectory stream; 0 = pick a free one", lo=0, hi=65535)
    curve_secret_key: str = f("", "Z85 CURVE secret key of the learner: if set, the stream is encrypted and only "
                                  "clients that know the public key connect (zmq.curve_keypair() makes a pair)")
    curve_public_key: str = f("", "the learner's Z85 CURVE public key; actors need it when CURVE is on")
    curve_secret_key_file: str = f("", "read curve_secret_key from this file (a Kubernetes Secret volume, a systemd "
                                       "credential); CURVE is required when the stream binds off loopback")
    curve_public_key_file: str = f("", "read curve_public_key from this file")
    curve_client_keys: str = f("", "Z85 CURVE public keys of the actors allowed to connect, separated by commas or "
                                   "spaces (each actor's actor.stream_curve_public_key): the stream's ZAP handler "
                                   "refuses every other client during the handshake. Empty: encryption only, any "
                                   "client that knows curve_public_key connects (off loopback that needs "
                                   "curve_allow_any_client)")
    curve_client_keys_file: str = f("", "read curve_client_keys from this file (keys separated by commas, spaces or "
                                        "lines) or from every file of this directory (a Kubernetes Secret volume); re-read "
                                        "while the learner runs: keys added or taken out apply to new connections")
    curve_allow_any_client: bool = f(False, "serve a CURVE stream off loopback without curve_client_keys (encryption "
                                            "only: whoever knows the learner's public key may send trajectories)")
    credits: int = f(512, "trajectories an actor may have in flight to the learner (flow control)", lo=1)
    max_frame_bytes: int = f(64 << 20, "larger frames are dropped and counted", lo=1)
    queue_size: int = f(4096, "trajectories the learner holds in memory (queue + credit promised to actors)", lo=1)
    ack_interval_s: float = f(0.002, "longest a WAL batch waits to grow before its fdatasync (sooner once it holds "
                                     "what arrives during one fdatasync)", lo=0)
    grant_ttl_s: float = f(1800.0, "an admitted episode (ADMIT's grant) that has not arrived this long after it was "
                                   "granted is given back to the admission bound (grants_expired), so that an actor "
                                   "that admits episodes and never sends them cannot hold the bound shut while it "
                                   "pings; set it above the longest honest episode (one arriving later is still "
                                   "trained on); 0 = never", lo=0)
    fsync: bool = f(True, "fdatasync the trajectory WAL before acking (off: faster, loses acked data on power loss)")
    wal_writer: str = f("process", "who checksums, writes and fdatasyncs the WAL: process (a writer process fed "
                                   "through shared memory; the learner process only copies each trajectory once) "
                                   "| thread (a thread of the learner process)", choices=("process", "thread"))
    durability: str = f("wal", "wal: ack a trajectory once it is fsynced in the learner's write-ahead log | "
                               "checkpoint: no WAL; ack it once a checkpoint that consumed it is on disk (actors "
                               "keep everything since the last checkpoint: faster, more actor memory)",
                        choices=("wal", "checkpoint"))


def _section(cls, help: str) -> Any:
    return field(default_factory=cls, metadata={"help": help})


ALGOS = ("ppo", "grpo")


@dataclass
class LearnerConfig:
    """learner: consumes trajectories, trains, publishes weights."""

    algo: str = f("ppo", "ppo (PPO with a critic: GAE advantages, or V-trace under learner.correction.kind=vtrace) | "
                         "grpo (group-centred returns, no critic)", choices=ALGOS)
    batch_size: int = f(64, lo=1, help="trajectories per policy update (B in the staleness rule)")
    lr: float = f(1e-3, lo=0, help="policy learning rate (AdamW)")
    critic_lr: float = f(2e-3, lo=0, help="critic learning rate")
    weight_decay: float = f(0.0, "AdamW weight decay of the policy and the critic", lo=0)
    warmup_steps: int = f(20, "linear learning-rate warm-up, in updates", lo=0)
    grad_clip: float = f(1.0, "gradient norm clip", gt=0)
    threads: int = f(1, "torch intra-op threads", lo=1)
    device: str = f("auto", "where the learner (and tars sft) trains: auto (cuda when available, else cpu) | cpu | cuda | "
                            "cuda:N; under accelerate with several processes, auto/cuda = cuda:LOCAL_RANK with NCCL")
    precision: str = f("auto", "auto (bf16 autocast on CUDA, fp32 on CPU) | fp32 | bf16 (autocast, fp32 master weights "
                               "and optimizer state; allowed on the CPU too, via CPU autocast)")
    parallel: str = f("ddp", "several processes under accelerate launch: ddp (weights and optimizer replicated, gradients "
                             "all-reduced) | fsdp (FSDP2 fully_shard: parameters, gradients and optimizer state sharded "
                             "over the ranks); one process ignores it")
    dist_timeout_s: float = f(7200.0, "several processes: how long a collective may wait for the other ranks (the process "
                                      "group's timeout) while rank 0 works alone (a checkpoint, a publish, an export); "
                                      "while it waits for a batch it keeps the ranks alive, however long", lo=5, hi=86400 * 7)
    archive: bool = f(False, "append every trajectory received to run_dir/trajectories.twl (for tars data split / tars sft)")
    ppo: PPOConfig = _section(PPOConfig, "the policy loss")
    correction: CorrectionConfig = _section(CorrectionConfig, "the off-policy correction of the loss")
    staleness: StalenessConfig = _section(StalenessConfig, "how off-policy a trained trajectory may be")
    group: GroupConfig = _section(GroupConfig, "GRPO groups")
    value_pretrain: ValuePretrainConfig = _section(ValuePretrainConfig, "critic-only updates first")
    checkpoint: CheckpointConfig = _section(CheckpointConfig, "checkpoints")
    publish: PublishConfig = _section(PublishConfig, "weights to the inference servers")
    stream: StreamConfig = _section(StreamConfig, "the trajectory stream")

    def config_error(self) -> str:
        """What is wrong with this learner config that no single field can say ("" when nothing): the config loader
        raises it as a ConfigError, PPOTrainer as a ValueError."""
        if self.algo not in ALGOS:
            return f"learner.algo: {self.algo!r} is not one of {' | '.join(ALGOS)}"
        if self.publish.mode not in PublishConfig.MODES:
            return f"learner.publish.mode: {self.publish.mode!r} is not one of {' | '.join(PublishConfig.MODES)}"
        if self.parallel not in ("ddp", "fsdp"):
            return f"learner.parallel: {self.parallel!r} is not one of ddp | fsdp"
        kind = self.correction.kind
        if kind not in CorrectionConfig.KINDS:
            return f"learner.correction.kind: {kind!r} is not one of {' | '.join(CorrectionConfig.KINDS)}"
        if kind == "vtrace" and self.algo != "ppo":
            return f"learner.correction.kind=vtrace needs a critic (learner.algo=ppo), not learner.algo={self.algo}"
        if not math.isfinite(self.ppo.truncated_value):
            return f"learner.ppo.truncated_value must be finite, got {self.ppo.truncated_value}"
        for name in ("rho_bar", "c_bar", "tis_cap"):
            if not getattr(self.correction, name) > 0:
                return f"learner.correction.{name} must be > 0, got {getattr(self.correction, name)}"
        return ""

    # Keys of the flat layout (before the sections) -> their full key now.
    MOVED: ClassVar[dict[str, str]] = {
        **{k: f"learner.ppo.{k}" for k in ("eps_low", "eps_high", "behav_cap", "gamma", "lam_policy", "lam_critic",
                                   "length_adaptive", "length_alpha", "value_clip", "epochs", "minibatches",
                                   "adv_norm", "neg_adv_weight", "entropy_coef", "target_entropy", "entropy_coef_lr",
                                   "entropy_coef_max", "kl_coef")},
        "eta": "learner.staleness.eta", "max_lag": "learner.staleness.max_lag",
        "value_pretrain_steps": "learner.value_pretrain.steps", "value_pretrain_ev": "learner.value_pretrain.target_ev",
        "checkpoint_every": "learner.checkpoint.every", "keep_weights": "learner.publish.keep_versions",
        "stream_host": "learner.stream.host", "stream_port": "learner.stream.port",
        "stream_curve_secret_key": "learner.stream.curve_secret_key", "stream_curve_public_key": "learner.stream.curve_public_key",
        "credits": "learner.stream.credits", "max_frame_bytes": "learner.stream.max_frame_bytes",
        "stream_queue_size": "learner.stream.queue_size", "stream_ack_interval_s": "learner.stream.ack_interval_s",
        "stream_fsync": "learner.stream.fsync", "stream_durability": "learner.stream.durability",
    }
