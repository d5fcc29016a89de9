"""Wire format of the trajectory stream (actor DEALER <-> learner ROUTER): every control message, typed, in one place.

Every message is multipart: [tag (1 byte), body (msgpack map)] and, for TRAJ only, a third frame holding the
Trajectory.encode() bytes untouched (the learner decodes it once to validate, and writes those same bytes to its WAL),
then one frame per attached screenshot. The ROUTER sees an identity frame in front (the actor id, set by the DEALER
as its routing id).

actor -> learner
  HELLO  Hello    (re)introduce: incarnation is a fresh uuid per actor process, pending_ids the unacked trajectory
                  ids in the outbox, inflight the admitted episodes not yet sent
  TRAJ   Traj     one trajectory; spends one credit. images names the extra frames (sha256 hex of each),
                  screenshots not yet sent on this connection (core/stream/images.py)
  ADMIT  Admit    ask for n episode starts (staleness manager)
  LOST   Lost     give back n admitted episodes that will never be sent
  PING   Ping     heartbeat; answered by PONG (or WHO from a learner that does not know this actor, e.g. after a
                  learner restart). Optional, to a learner whose WELCOME said confirms: forgot, at most MAX_CONFIRM
                  ids the actor got the final ACK for and deleted (outbox, spool file), and cseq, echoed by the PONG;
                  the learner may then forget those ids once nothing of its own can bring them back (confirm.py)
learner -> actor
  WELCOME Welcome answer to HELLO; credit is ABSOLUTE (resets the actor's count); the actor ignores a WELCOME
                  answering an older HELLO. confirms: this learner reads PING's forgot (older ones leave it out)
  CREDIT  Credit  n more TRAJ may be sent (queue drained)
  ACK     Ack     without held: these ids are durable (fsynced in the WAL, or in a durable checkpoint): forget them.
                  held=run_id (durability "checkpoint"): that learner run has them in memory and will ack them again
                  once a checkpoint covers them; keep them, do not re-send them to that run
  NACK    Nack    retry=False: the frame is bad, drop it and count it; retry=True: the learner had no room, send it
                  again later; missing: image hashes to attach again on the re-send
  GRANT   Grant   answer to ADMIT
  VERSION Version the policy version changed
  PONG    Pong    heartbeat answer; a changed run_id means a learner restart; cseq: the PING's, when it had one
  WHO     Who     "say HELLO first"

Each class's body() is the msgpack map on the wire (field names as before, optional fields left out when empty, so
the bytes are what earlier builds sent and read), and from_body() is its one validating decode: a missing field or
one of the wrong type raises ProtocolError, which the receiving end counts and drops like any garbage frame. Keys a
decoder does not know are ignored, so a newer peer may add fields.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from core.schema import unpack_bounded

HELLO, TRAJ, ADMIT, LOST, PING = b"H", b"T", b"A", b"L", b"P"
WELCOME, CREDIT, ACK, NACK, GRANT, VERSION, PONG, WHO = b"W", b"C", b"K", b"N", b"G", b"V", b"O", b"?"

# Largest control body we will unpack (pending_ids of a 64k window fits easily); bounds msgpack's allocations.
MAX_BODY_BYTES = 8 << 20
MAX_BODY_ITEMS = 1 << 20  # one body's msgpack budget (core.schema.unpack_bounded): HELLO's 64k pending ids fit
MAX_CONFIRM = 4096  # ids one PING confirms (the learner reads no more of one)


class ProtocolError(ValueError):
    """A control message that does not decode: not a small msgpack map, an unknown tag, or a field missing or of the
    wrong type. msg_id is the body's "id" when that was a string (a TRAJ header), so a refusal can name it."""

    def __init__(self, what: str, msg_id: str | None = None):
        super().__init__(what)
        self.msg_id = msg_id


def pack(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def unpack(b: bytes) -> dict:
    """A control body as a map; raises ProtocolError for anything that is not a small msgpack map."""
    if len(b) > MAX_BODY_BYTES:
        raise ProtocolError(f"control body of {len(b)} bytes")
    try:
        d = unpack_bounded(b, MAX_BODY_BYTES, MAX_BODY_ITEMS)
    except Exception as e:  # msgpack raises several types for garbage
        raise ProtocolError(f"body is not msgpack: {type(e).__name__}") from None
    if not isinstance(d, dict):
        raise ProtocolError(f"body is a {type(d).__name__}, expected a map")
    return d


# --- field readers: each returns the value or raises ProtocolError ---------------------------------------------------
_REQUIRED: Any = object()


def _get(raw: dict, name: str, ok, kind: str, default):
    if name not in raw:
        if default is _REQUIRED:
            raise ProtocolError(f"{name} missing")
        return default
    v = raw[name]
    if not ok(v):
        raise ProtocolError(f"{name} is {type(v).__name__}, expected {kind}")
    return v


def _is_str(v) -> bool:
    return isinstance(v, str)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_bool(v) -> bool:
    return isinstance(v, bool)


def _is_strs(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _str(raw: dict, name: str, default=_REQUIRED) -> str:
    return _get(raw, name, _is_str, "str", default)


def _int(raw: dict, name: str, default=_REQUIRED) -> int:
    return _get(raw, name, _is_int, "int", default)


def _bool(raw: dict, name: str, default=_REQUIRED) -> bool:
    return _get(raw, name, _is_bool, "bool", default)


def _strs(raw: dict, name: str, default=_REQUIRED) -> list[str]:
    return _get(raw, name, _is_strs, "a list of str", default)


class Message(ABC):
    """One control message: TAG on the wire, body() to send, from_body() to read (see the module docstring)."""

    __slots__ = ()
    TAG: ClassVar[bytes]

    @abstractmethod
    def body(self) -> dict:
        """The msgpack map sent on the wire."""

    @classmethod
    @abstractmethod
    def from_body(cls, raw: dict) -> Message:
        """The validating decode of an unpacked body; raises ProtocolError."""

    def encode(self) -> list[bytes]:
        """[tag, body] frames (a TRAJ appends its payload and image frames)."""
        return [self.TAG, pack(self.body())]


# --- actor -> learner ------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Hello(Message):
    TAG: ClassVar[bytes] = HELLO
    actor: str
    incarnation: str
    hello_id: int
    pending_ids: list[str] = field(default_factory=list)
    inflight: int = 0

    def body(self) -> dict:
        return {"actor": self.actor, "incarnation": self.incarnation, "hello_id": self.hello_id,
                "pending_ids": self.pending_ids, "inflight": self.inflight}

    @classmethod
    def from_body(cls, raw: dict) -> Hello:
        return cls(_str(raw, "actor"), _str(raw, "incarnation"), _int(raw, "hello_id"),
                   _strs(raw, "pending_ids", []), _int(raw, "inflight", 0))


@dataclass(slots=True)
class Traj(Message):
    """The header of a TRAJ; the payload and image frames follow it on the wire."""
    TAG: ClassVar[bytes] = TRAJ
    seq: int
    id: str
    images: list[str] = field(default_factory=list)

    def body(self) -> dict:
        return {"seq": self.seq, "id": self.id, "images": self.images}

    @classmethod
    def from_body(cls, raw: dict) -> Traj:
        # One per trajectory, on the receiver's io thread: the well-formed case in one check (msgpack gives exact
        # types), the field readers below only to name what is wrong.
        seq, tid, images = raw.get("seq"), raw.get("id"), raw.get("images", [])
        if type(seq) is int and type(tid) is str and tid and type(images) is list and all(
                type(h) is str for h in images):
            return cls(seq, tid, images)
        tid = tid if isinstance(tid, str) else None
        try:
            m = cls(_int(raw, "seq"), _str(raw, "id"), _strs(raw, "images", []))
        except ProtocolError as e:
            raise ProtocolError(str(e), tid) from None
        if not m.id:
            raise ProtocolError("id is empty", tid)
        return m


@dataclass(slots=True)
class Admit(Message):
    TAG: ClassVar[bytes] = ADMIT
    rid: int
    n: int

    def body(self) -> dict:
        return {"rid": self.rid, "n": self.n}

    @classmethod
    def from_body(cls, raw: dict) -> Admit:
        return cls(_int(raw, "rid"), _int(raw, "n"))


@dataclass(slots=True)
class Lost(Message):
    TAG: ClassVar[bytes] = LOST
    n: int

    def body(self) -> dict:
        return {"n": self.n}

    @classmethod
    def from_body(cls, raw: dict) -> Lost:
        return cls(_int(raw, "n"))


@dataclass(slots=True)
class Ping(Message):
    TAG: ClassVar[bytes] = PING
    cseq: int = 0  # echoed by the PONG: the learner has read forgot
    forgot: list[str] = field(default_factory=list)  # ids the actor forgot for good (core/stream/confirm.py)

    def body(self) -> dict:
        return {"cseq": self.cseq, "forgot": self.forgot} if self.forgot else {}

    @classmethod
    def from_body(cls, raw: dict) -> Ping:
        return cls(_int(raw, "cseq", 0), _strs(raw, "forgot", [])) if raw else cls()


# --- learner -> actor ------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Welcome(Message):
    TAG: ClassVar[bytes] = WELCOME
    run_id: str
    hello_id: int
    version: int
    credit: int
    max_frame_bytes: int
    confirms: bool = False  # the learner reads PING's forgot

    def body(self) -> dict:
        b = {"run_id": self.run_id, "hello_id": self.hello_id, "version": self.version, "credit": self.credit,
             "max_frame_bytes": self.max_frame_bytes}
        return {**b, "confirms": True} if self.confirms else b

    @classmethod
    def from_body(cls, raw: dict) -> Welcome:
        return cls(_str(raw, "run_id"), _int(raw, "hello_id"), _int(raw, "version"), _int(raw, "credit"),
                   _int(raw, "max_frame_bytes"), _bool(raw, "confirms", False))


@dataclass(slots=True)
class Credit(Message):
    TAG: ClassVar[bytes] = CREDIT
    n: int

    def body(self) -> dict:
        return {"n": self.n}

    @classmethod
    def from_body(cls, raw: dict) -> Credit:
        return cls(_int(raw, "n"))


@dataclass(slots=True)
class Ack(Message):
    TAG: ClassVar[bytes] = ACK
    ids: list[str]
    held: str = ""  # run_id of the learner that holds them in memory until a checkpoint; "" = durable, forget them

    def body(self) -> dict:
        return {"ids": self.ids, "held": self.held} if self.held else {"ids": self.ids}

    @classmethod
    def from_body(cls, raw: dict) -> Ack:
        return cls(_strs(raw, "ids"), _str(raw, "held", ""))


@dataclass(slots=True)
class Nack(Message):
    TAG: ClassVar[bytes] = NACK
    id: str | None  # None when the refused TRAJ named no usable id
    reason: str
    retry: bool
    missing: list[str] = field(default_factory=list)

    def body(self) -> dict:
        b = {"id": self.id, "reason": self.reason, "retry": self.retry}
        if self.missing:
            b["missing"] = self.missing
        return b

    @classmethod
    def from_body(cls, raw: dict) -> Nack:
        tid = raw.get("id")
        if tid is not None and not isinstance(tid, str):
            raise ProtocolError(f"id is {type(tid).__name__}, expected str or nil")
        return cls(tid, _str(raw, "reason"), _bool(raw, "retry"), _strs(raw, "missing", []))


@dataclass(slots=True)
class Grant(Message):
    TAG: ClassVar[bytes] = GRANT
    rid: int
    granted: int
    version: int

    def body(self) -> dict:
        return {"rid": self.rid, "granted": self.granted, "version": self.version}

    @classmethod
    def from_body(cls, raw: dict) -> Grant:
        return cls(_int(raw, "rid"), _int(raw, "granted"), _int(raw, "version"))


@dataclass(slots=True)
class Version(Message):
    TAG: ClassVar[bytes] = VERSION
    v: int

    def body(self) -> dict:
        return {"v": self.v}

    @classmethod
    def from_body(cls, raw: dict) -> Version:
        return cls(_int(raw, "v"))


@dataclass(slots=True)
class Pong(Message):
    TAG: ClassVar[bytes] = PONG
    run_id: str
    cseq: int = 0  # the PING's, when it confirmed ids

    def body(self) -> dict:
        return {"run_id": self.run_id, "cseq": self.cseq} if self.cseq else {"run_id": self.run_id}

    @classmethod
    def from_body(cls, raw: dict) -> Pong:
        return cls(_str(raw, "run_id"), _int(raw, "cseq", 0))


@dataclass(slots=True)
class Who(Message):
    TAG: ClassVar[bytes] = WHO

    def body(self) -> dict:
        return {}

    @classmethod
    def from_body(cls, raw: dict) -> Who:
        return cls()


TO_LEARNER: dict[bytes, type[Message]] = {m.TAG: m for m in (Hello, Traj, Admit, Lost, Ping)}
TO_ACTOR: dict[bytes, type[Message]] = {m.TAG: m for m in (Welcome, Credit, Ack, Nack, Grant, Version, Pong, Who)}


def parse(kinds: dict[bytes, type[Message]], tag: bytes, raw: dict) -> Message:
    """The typed message for an unpacked body; kinds is TO_LEARNER or TO_ACTOR (the tags that direction carries)."""
    cls = kinds.get(tag)
    if cls is None:
        raise ProtocolError(f"unknown tag {tag!r}")
    return cls.from_body(raw)


def decode(kinds: dict[bytes, type[Message]], tag: bytes, body: bytes) -> Message:
    """unpack + parse: one ProtocolError for anything that is not a well-formed message of that direction."""
    return parse(kinds, tag, unpack(body))
