"""Run a command with some system calls refused (EPERM), as the seccomp filters of systemd's sandboxing directives
refuse them: `python seccomp_deny.py NAME,NAME,... -- ARGV...` (x86_64; an empty list refuses nothing).

DENIED_BY maps a unit directive to the system calls its filter refuses outright (systemd's src/shared/seccomp-util.c:
seccomp_protect_hostname, the @clock, @module and syslog groups); directives whose filters look at arguments
(RestrictSUIDSGID=, LockPersonality=, RestrictRealtime=, MemoryDenyWriteExecute=) are not modelled.
"""
from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys

DENIED_BY = {
    "ProtectHostname": ["sethostname", "setdomainname"],
    "ProtectClock": ["adjtimex", "clock_adjtime", "clock_settime", "settimeofday"],
    "ProtectKernelModules": ["init_module", "finit_module", "delete_module"],
    "ProtectKernelLogs": ["syslog"],
}
NR_X86_64 = {"syslog": 103, "adjtimex": 159, "settimeofday": 164, "sethostname": 170, "setdomainname": 171,
             "init_module": 175, "delete_module": 176, "clock_settime": 227, "clock_adjtime": 305, "finit_module": 313}
AUDIT_ARCH_X86_64 = 0xC000003E


def supported() -> bool:
    return sys.platform == "linux" and platform.machine() == "x86_64"


def _program(names: list[str]) -> bytes:
    """A classic BPF seccomp program: other architectures and other calls allowed, `names` -> EPERM."""
    ld, jeq, ret = 0x20, 0x15, 0x06                  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
    allow, eperm = 0x7FFF0000, 0x00050000 | 1        # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("HBBI", code, jt, jf, k)

    nrs = [NR_X86_64[n] for n in names]
    prog = [op(ld, 4), op(jeq, AUDIT_ARCH_X86_64, 1, 0), op(ret, allow), op(ld, 0)]   # arch, then the call number
    for i, nr in enumerate(nrs):
        prog.append(op(jeq, nr, len(nrs) - i, 0))    # a match jumps to the EPERM below
    return b"".join(prog + [op(ret, allow), op(ret, eperm)])


def install(names: list[str]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    prog = _program(names)
    buf = ctypes.create_string_buffer(prog, len(prog))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(prog) // 8, ctypes.addressof(buf))
    if libc.prctl(38, 1, 0, 0, 0) != 0:              # PR_SET_NO_NEW_PRIVS (as NoNewPrivileges=yes)
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:   # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")


if __name__ == "__main__":
    spec, sep, *argv = sys.argv[1:]
    assert sep == "--" and argv, "usage: seccomp_deny.py NAME,... -- ARGV..."
    install([n for n in spec.split(",") if n])
    os.execvp(argv[0], argv)
