"""Checks the `tars` commands run before any work: each problem a user error (core.config.UserError, or the model's
own core.chat.TokenizerError / core.model.UnsupportedModel) whose message names the path, setting or task and what
to do instead; tars.cli prints it as one line and exits 2.

    model_dir      a checkpoint directory: there, a directory, config.json of a supported model, weights whose
                   safetensors headers read whole (weights), a tokenizer that fits
    tokenizer_dir  a tokenizer directory (and, given a model directory, that its vocabulary fits the model's)
    out_dir        an output directory that can be created (or is one) and written to
    device         learner.device on this machine (cuda without CUDA, a cuda:N beyond the devices there)
    inference_device  inference.device / inference.precision of the local engine on this machine (the same)
    env_ids        every env id has a backend and, where the backend lists its tasks, is one of them
    env_options    every env id's backend takes the session options (names and values; envd.registry.check_options)
    screenshots    envd's screenshots are not turned off for a policy that is shown them
    demo_env_ids   every env id has scripted demonstrations (builtin tasks; MiniWoB++'s oracle tasks)
    metrics_ports  a run's fixed /metrics ports (telemetry.prometheus_port N > 0: one per role) exist and are free
"""
from __future__ import annotations

import os
import pathlib
import tempfile

from core.config import ConfigError, UserError


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # what core.chat.ChatTokenizer.load reads


def model_dir(path: str, what: str = "--model", need_tokenizer: bool = True,
              template_kwargs: dict | None = None) -> pathlib.Path:
    """An HF-layout checkpoint directory this code can load, with a tokenizer that fits it. need_tokenizer=False
    (the learner, the inference server: token ids in, token ids out): a tokenizer that is there must still fit; it
    needs no chat template (a base model's has none)."""
    from core.chat import TokenizerError, open_tokenizer
    from core.model import UnsupportedModel, load_config

    p = pathlib.Path(path).expanduser()
    if not p.exists():
        raise UserError(f"{what} {path}: no such directory (give a Hugging Face checkpoint directory)")
    if not p.is_dir():
        raise UserError(f"{what} {path}: a file, not a checkpoint directory (config.json, model.safetensors, "
                        "tokenizer files)")
    if not (p / "config.json").is_file():
        raise UserError(f"{what} {path}: no config.json here (a checkpoint directory holds config.json + "
                        "model.safetensors + the tokenizer files)")
    try:
        load_config(p)  # UnsupportedModel (a user error) for an architecture this code cannot run
    except UnsupportedModel:
        raise
    except Exception as e:  # noqa: BLE001 - a config.json that is no model's: bad JSON, wrong types, zero heads, ...
        msg = " ".join(str(e).split()) or type(e).__name__
        raise UserError(f"{what} {path}: config.json cannot be read as a model config ({type(e).__name__}: "
                        f"{msg[:300]})") from None
    weights(p, f"{what} {path}")
    if need_tokenizer or any((p / n).is_file() for n in TOKENIZER_FILES):
        try:
            # a missing tokenizer, one whose vocabulary does not fit the model, a template failing on template_kwargs;
            # without need_tokenizer (token ids in and out) only the fit: a base model's needs no chat template
            open_tokenizer(p, p, template_kwargs, chat=need_tokenizer)
        except TokenizerError as e:
            raise TokenizerError(f"{what} {path}: {e}") from None
    return p.resolve()


def weights(path: str | os.PathLike, what: str) -> None:
    """The checkpoint's safetensors files (model.safetensors, or the index and every shard it lists) have whole
    headers whose tensors fit the file: a truncated copy is a UserError here, not a failure once loading."""
    from core.model_files import MissingWeights, check_weights

    try:
        check_weights(path)
    except (MissingWeights, ValueError, OSError) as e:
        raise UserError(f"{what}: {e}") from None


def tokenizer_dir(path: str, model: str | os.PathLike | None = None, what: str = "--tokenizer",
                  template_kwargs: dict | None = None) -> None:
    from core.chat import TokenizerError, open_tokenizer

    try:
        open_tokenizer(path, model, template_kwargs)
    except TokenizerError as e:
        raise TokenizerError(f"{what} {path}: {e}") from None


def out_dir(path: str, what: str = "--out") -> pathlib.Path:
    """An output directory: an existing directory, or one that can be made under its nearest existing parent.
    Nothing is left behind: the check makes (and removes) a temporary directory in that parent."""
    p = pathlib.Path(path).expanduser().absolute()
    if p.exists() and not p.is_dir():
        raise UserError(f"{what} {path}: exists and is not a directory")
    up = p
    while not up.exists():
        up = up.parent
    if not up.is_dir():
        raise UserError(f"{what} {path}: {up} is a file, so no directory can be made under it")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".tars-write-check.", dir=up))
    except OSError as e:
        raise UserError(f"{what} {path}: cannot write in {up}: {e.strerror or e}") from None
    return p


def device(cfg) -> None:
    """learner.device is usable here (a ConfigError naming the setting otherwise): checked at the start of the
    commands that train, before any demonstration, model or process."""
    from learner.device import resolve_device, resolve_precision

    resolve_precision(cfg.learner.precision, resolve_device(cfg.learner.device))


def inference_device(cfg, engine: str | None = None) -> None:
    """inference.device / inference.precision are usable here when the engine is the local one (a ConfigError
    naming the setting otherwise): checked before `tars serve` (and `tars up`) loads any model."""
    from core.device import resolve_device, resolve_precision

    if (engine or cfg.inference.engine) == "local":  # `tars serve --engine` is in cfg (tars.cli._option_sets)
        resolve_precision(cfg.inference.precision, resolve_device(cfg.inference.device, "inference.device"),
                          "inference.precision")


def env_ids(ids, what: str = "actor.env_ids") -> None:
    from envd import registry

    if not list(ids):
        raise ConfigError(f"{what} is empty: name at least one env id (e.g. builtin/mixed)")
    listed = registry.list_env_ids()
    for e in ids:
        try:
            prefix, name, _ = registry.resolve(str(e))
        except KeyError as err:
            raise ConfigError(f"{what}: {err.args[0]}") from None
        have = [x for x in listed if x == prefix or x.startswith(prefix + "/")]
        if not have or have == [prefix] or str(e).strip() in have:
            continue  # open-ended (or not installed here: envd says so when it starts), or a listed task
        names = [x.split("/", 1)[1] for x in have if "/" in x]
        more = f", ... ({len(names)} in all)" if len(names) > 12 else ""
        raise ConfigError(f"{what}: unknown env id {e!r}: {prefix} has no task {name!r} (it has "
                          f"{', '.join(names[:12])}{more}; `tars config` lists the settings)")


def env_hosts(ids, what: str = "actor.env_ids") -> None:
    """The host programs the env ids' backends need (chromium, bubblewrap, socat, Xvfb, ...), for a command that runs
    them on this host (`tars up`'s envd, `tars sft --demos`): a missing one is a UserError naming the env id and the
    programs, before anything starts, not an infra error at the first session. Run it after env_ids."""
    from envd import registry

    for e in dict.fromkeys(str(x).strip() for x in ids):
        if lacking := registry.missing_programs(e):
            raise UserError(f"{what}: {e} needs {', '.join(lacking)}, not installed on this host "
                            "(`bash scripts/setup.sh --dev` installs what the GUI backends need)")


def env_options(ids, options, what: str = "actor.env_options") -> None:
    """The options a session of each env id would be created with, checked by its backend's own parser (nothing is
    started): an unknown name (a typo would leave the option unapplied for a whole run) or a bad value is a
    ConfigError naming `what`, the env id and the backend's message. Run it after env_ids, which reports an id no
    backend serves in its own words; a backend registered without a checker is not checked."""
    from envd import registry

    opts = {str(k): str(v) for k, v in (options or {}).items()}
    for e in dict.fromkeys(str(x) for x in ids):
        try:
            registry.check_options(e, opts, remote=True)   # the options travel to envd in a CreateSession
        except (KeyError, ValueError) as err:
            msg = err.args[0] if isinstance(err, KeyError) and err.args else err
            raise ConfigError(f"{what} for {e}: {msg}") from None


def judge(actor_cfg, starts_server: bool) -> None:
    """actor.judge_model: a checkpoint this code serves, with a tokenizer that writes chat prompts; without
    actor.judge_inference, only where the judge's server is started here (`starts_server`: tars up)."""
    if actor_cfg.judge_mode == "off" or not actor_cfg.judge_model:
        return
    if actor_cfg.unserved_judge and not starts_server:
        raise ConfigError(f"actor.judge_model={actor_cfg.judge_model!r} needs the servers that serve it: "
                          "actor.judge_inference=HOST:PORT (`tars up` starts one)")
    model_dir(actor_cfg.judge_model, "actor.judge_model", template_kwargs=actor_cfg.chat_template_kwargs)


def screenshots(actor_cfg, model_path: str = "") -> None:
    """actor.env_options turning envd's screenshots off for a policy that is shown screenshots (actor.image_history
    > 0, or -1 with a vision-language checkpoint at model_path): the actor would refuse to start."""
    from actor.uitars import images_shown
    from core.vlm import is_vl_dir

    try:
        images_shown(actor_cfg, bool(model_path) and is_vl_dir(model_path))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def demo_env_ids(ids, what: str = "actor.env_ids", demonstrator: str = "oracle") -> None:
    """Scripted demonstrations (tars.demos) exist for the builtin tasks and for the MiniWoB++ tasks the DOM oracle
    knows (oracle and noisy:P there; confused:P only on builtin tasks)."""
    from envd import builtin
    from envd.miniwob_oracle import ORACLE_TASKS
    from tars.demos import is_builtin

    web = demonstrator.split(":", 1)[0] != "confused"
    bad = [e for e in ids if not (is_builtin(e) or (web and str(e).startswith("miniwob/")
                                                     and str(e).split("/", 1)[1] in ORACLE_TASKS))]
    if bad:
        mw = (f" and, for oracle and noisy:P, the MiniWoB++ tasks of the DOM oracle ({', '.join('miniwob/' + t for t in ORACLE_TASKS)})"
              if web else " (the confused demonstrator); oracle and noisy:P also cover the MiniWoB++ tasks of the DOM oracle")
        raise ConfigError(
            f"{what} has {', '.join(map(repr, bad))}: scripted demonstrations exist only for the builtin tasks "
            f"({', '.join('builtin/' + t for t in builtin.TASKS)}){mw}. For other tasks, record episodes first (`tars up "
            "--set learner.archive=true` writes RUN/trajectories.twl), then `tars data split RUN/trajectories.twl "
            "--out DATA` and `tars sft --data DATA/sft.twl`; or set sft.steps=0 / leave out --demos")


def metrics_ports(cfg, ports: dict) -> None:
    """Every role's /metrics port (topology.Plan.metrics_ports: N, N+1, ...) is a port and free on
    telemetry.prometheus_host, so that no role fails after the model is built."""
    import socket

    host = cfg.telemetry.prometheus_host.strip()
    for (role, i), port in ports.items():
        what = (f"telemetry.prometheus_port={cfg.telemetry.prometheus_port} (ports {min(ports.values())}-"
                f"{max(ports.values())}, one per role; 0 = a free port per role, named in run/ROLE.json)")
        if port > 65535:
            raise ConfigError(f"{what}: {role} {i} would get port {port} > 65535")
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
            with socket.socket(family[0], socket.SOCK_STREAM) as s:
                s.bind(family[4])
        except OSError as e:
            raise ConfigError(f"{what}: port {port} ({role} {i}) on {host}: {e}") from None
