"""Auth rules every listener shares: no secret-less service off loopback, and secrets read from files.

check_listener() is the one check a server runs before it binds: on a loopback address anything goes (a local
dev run; `tars up` still hands every role its per-run tokens), on any other address every secret the listener
depends on must be set, else InsecureBind (each role's command prints it and exits with status 2):

    envd, inference server   their service token (envd.auth_token / inference.auth_token) and control.auth_token
                             (the ControlService shares their listener)
    trajectory stream        CURVE (learner.stream.curve_secret_key) and the allowlist of actor keys
                             (learner.stream.curve_client_keys), unless learner.stream.curve_allow_any_client
    /metrics (every role)    telemetry.prometheus_token, unless telemetry.prometheus_allow_no_token (a firewalled
                             port; core.telemetry.setup)
    actor / learner control  bind 127.0.0.1 only (control.auth_token guards them all the same)

read_secret_files() is the `*_file` convention: a string field X with a sibling X_file (envd.auth_token_file,
control.auth_token_file, learner.stream.curve_secret_key_file, ...) takes its value from that file, so a secret
can come from a Kubernetes Secret volume or a systemd credential ($CREDENTIALS_DIRECTORY, `%d` in a unit) and
never sits in a unit file, a manifest or a command line. A key list (learner.stream.curve_client_keys_file) is a file
of keys or a directory of such files (read_key_list).
"""
from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import stat

log = logging.getLogger("tars.auth")

FILE_SUFFIX = "_file"
MAX_SECRET_BYTES = 4096
MAX_KEY_LIST_BYTES = 1 << 20  # ~25,000 Z85 keys
KEY_LISTS = frozenset({"curve_client_keys"})  # fields whose *_file holds several keys (read_key_list)
_warned: set[tuple[str, str, str]] = set()


class InsecureBind(ValueError):
    """A listener asked to serve off loopback without the secret that guards it."""


class SecretFileError(ValueError):
    """A `*_file` field names a file that cannot be used."""


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and `localhost`; everything else (0.0.0.0, ::, '', names, private addresses) is not."""
    h = (host or "").strip().strip("[]")
    if h.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def check_listener(role: str, what: str, host: str, needs: dict[str, str]) -> None:
    """Refuse to serve `what` on a non-loopback `host` while any of `needs` ({setting name: value}) is empty."""
    missing = [name for name, value in needs.items() if not value]
    if not missing:
        return
    if is_loopback(host):
        if (role, what, host) not in _warned:
            _warned.add((role, what, host))
            log.warning("%s: %s on %s without %s: any local process may call it", role, what, host, ", ".join(missing))
        return
    raise InsecureBind(
        f"{role}: refusing to serve {what} on {host!r}, which is not a loopback address, without "
        f"{' and '.join(missing)}: anyone who can reach this host could use it. Set {'them' if len(missing) > 1 else 'it'} "
        f"(or the matching *_file setting; docs/deploy.md) or bind 127.0.0.1")


Z85 = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")


def client_keys(text: str) -> list[str]:
    """learner.stream.curve_client_keys as a list: Z85 keys separated by commas or white space."""
    return text.replace(",", " ").split()


def _key_error(setting: str, key: str) -> str | None:
    if len(key) != 40 or not set(key) <= Z85:
        return (f"{setting}: not a CURVE key (40 Z85 characters, as zmq.curve_keypair() makes; this one has "
                f"{len(key)} characters)")
    return None


def _pair_error(public_setting: str, public: str, secret_setting: str, secret: str) -> str | None:
    """A public key set beside its secret key must be the secret key's (the peers given it could never connect)."""
    if not (public and secret):
        return None
    import zmq

    try:
        derived = zmq.curve_public(secret.encode()).decode()
    except (zmq.ZMQError, AttributeError):
        return None  # libzmq without CURVE: the role says so when it starts the stream
    if derived != public:
        return f"{public_setting} is not the public key of {secret_setting}: the stream's peers could not use it"
    return None


def secrets_error(cfg) -> str | None:
    """Why a RunConfig's secrets cannot work, or None. A bearer token travels in a gRPC header, which takes visible
    ASCII only (any other character failed every call of every client with gRPC's own ExecuteBatchError, not even
    an RpcError); a CURVE key is 40 Z85 characters (anything else stopped the learner or actor with ZMQError
    "Invalid argument"), and a public key must be the one of its secret key (the learner's: actors given it could
    never connect; an actor's: the learner's allowlist names the public key)."""
    for setting, token in (("envd.auth_token", cfg.envd.auth_token), ("inference.auth_token", cfg.inference.auth_token),
                           ("control.auth_token", cfg.control.auth_token),
                           ("telemetry.prometheus_token", cfg.telemetry.prometheus_token)):
        if token and not all("!" <= c <= "~" for c in token):
            return f"{setting}: a token must be visible ASCII characters only (it travels in a gRPC or HTTP header)"
    s, a = cfg.learner.stream, cfg.actor
    keys = [("learner.stream.curve_secret_key", s.curve_secret_key), ("learner.stream.curve_public_key", s.curve_public_key),
            ("actor.stream_curve_secret_key", a.stream_curve_secret_key),
            ("actor.stream_curve_public_key", a.stream_curve_public_key)]
    allowed = client_keys(s.curve_client_keys)
    keys += [(f"learner.stream.curve_client_keys (key {i + 1} of {len(allowed)})", k) for i, k in enumerate(allowed)]
    for setting, key in keys:
        if key and (err := _key_error(setting, key)):
            return err
    if bool(a.stream_curve_public_key) != bool(a.stream_curve_secret_key):
        return ("actor.stream_curve_public_key and actor.stream_curve_secret_key: set both (the actor's CURVE keypair) "
                "or neither (a fresh keypair per actor process)")
    return (_pair_error("learner.stream.curve_public_key", s.curve_public_key, "learner.stream.curve_secret_key",
                        s.curve_secret_key)
            or _pair_error("actor.stream_curve_public_key", a.stream_curve_public_key, "actor.stream_curve_secret_key",
                           a.stream_curve_secret_key))


def read_secret(path: str, setting: str) -> str:
    """The stripped contents of a secret file (one line: a token or a Z85 key)."""
    value = _read_text(path, setting, MAX_SECRET_BYTES, "it should hold one secret")
    if any(c.isspace() for c in value):
        raise SecretFileError(f"{setting}: {path} holds more than one word; it should hold one secret")
    return value


def read_key_list(path: str, setting: str) -> str:
    """Keys separated by commas or white space, from a file or from every file of a directory (a Kubernetes Secret
    volume, one key per item; names that start with "." are skipped: the volume's own ..data links), comma-joined."""
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if not n.startswith("."))
        if not names:
            raise SecretFileError(f"{setting}: {path} is an empty directory; it should hold key files")
        files = [os.path.join(path, n) for n in names]
    else:
        files = [path]
    return ",".join(k for p in files for k in client_keys(_read_text(p, setting, MAX_KEY_LIST_BYTES, "a key list")))


def load_key_list(path: str, setting: str) -> list[str]:
    """read_key_list's keys, each checked (SecretFileError naming the first bad one): what a running learner re-reads
    when curve_client_keys_file changes (core/stream/curve.py)."""
    keys = client_keys(read_key_list(path, setting))
    for i, k in enumerate(keys):
        if err := _key_error(f"{setting}: {path} (key {i + 1} of {len(keys)})", k):
            raise SecretFileError(err)
    return keys


def _read_text(path: str, setting: str, limit: int, what: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SecretFileError(f"{setting}: {path} is not a regular file")
            data = os.read(fd, limit + 1)
        finally:
            os.close(fd)
    except OSError as e:
        raise SecretFileError(f"{setting}: cannot read {path}: {e.strerror or e}") from None
    if len(data) > limit:
        raise SecretFileError(f"{setting}: {path} is over {limit} bytes; {what}")
    try:
        value = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise SecretFileError(f"{setting}: {path} is not UTF-8 text") from None
    if not value:
        raise SecretFileError(f"{setting}: {path} is empty")
    if st.st_mode & stat.S_IROTH:
        log.warning("%s: %s is readable by every user of this machine (chmod o-r)", setting, path)
    return value


def read_secret_files(cfg, where: str = "") -> None:
    """Fill every field X from its X_file sibling, in place, through the whole config tree. X set as well is
    allowed only when it holds the same value (a config saved after it was read); anything else is ambiguous."""
    for fl in dataclasses.fields(cfg):
        value = getattr(cfg, fl.name)
        name = f"{where}{fl.name}"
        if dataclasses.is_dataclass(value):
            read_secret_files(value, name + ".")
        elif fl.name.endswith(FILE_SUFFIX) and value:
            target = fl.name[: -len(FILE_SUFFIX)]
            if not hasattr(cfg, target):
                continue
            secret = (read_key_list if target in KEY_LISTS else read_secret)(str(value), name)
            current = getattr(cfg, target)
            if current and current != secret:
                raise SecretFileError(f"{where}{target} and {name} are both set, to different values: set one")
            setattr(cfg, target, secret)
