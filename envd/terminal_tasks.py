"""Built-in shell tasks for the `terminal` backend: files seeded into the workspace at reset, and a verifier.

Every task is drawn from the reset seed (names, sizes and numbers change), and its verifier reads the workspace from
the daemon side. The workspace is written by the sandboxed agent, so the verifier trusts nothing in it: it reads
only top-level regular files, never follows a symlink, never blocks on a FIFO and reads a bounded number of bytes.

Tasks (option `task`):
  hello         create hello.txt containing `hi`
  count_lines   write the line count of data.csv (as `wc -l` counts) into count.txt
  sum_column    write the sum of the amount column of sales.csv into total.txt
  largest_file  write the name of the largest file under files/ into largest.txt
"""
from __future__ import annotations

import os
import pathlib
import random
import stat
from dataclasses import dataclass, field

from envd.workspace_archive import write_new

MAX_READ = 4096  # answers are short; a bigger file is read only this far


@dataclass
class TaskSpec:
    name: str
    instruction: str
    files: dict[str, bytes] = field(default_factory=dict)   # relative path -> content, seeded at reset
    answer: dict = field(default_factory=dict)              # what the verifier compares against (JSON-able)


def _hello(rng: random.Random) -> TaskSpec:
    return TaskSpec("hello", "Create a file hello.txt in /workspace containing the word hi.", answer={"text": "hi"})


def _count_lines(rng: random.Random) -> TaskSpec:
    rows = rng.randint(20, 200)
    lines = ["id,name,score"] + [f"{i},{rng.choice(['ann', 'bo', 'cy', 'di', 'ed'])},{rng.randint(0, 100)}"
                                 for i in range(1, rows + 1)]
    return TaskSpec("count_lines", "Count the lines of /workspace/data.csv (as `wc -l` counts them) and write just "
                    "the number into /workspace/count.txt.",
                    files={"data.csv": ("\n".join(lines) + "\n").encode()}, answer={"number": len(lines)})


def _sum_column(rng: random.Random) -> TaskSpec:
    amounts = [rng.randint(1, 999) for _ in range(rng.randint(10, 60))]
    items = ["apple", "pear", "fig", "kiwi", "plum", "lime"]
    text = "item,amount\n" + "".join(f"{rng.choice(items)},{a}\n" for a in amounts)
    return TaskSpec("sum_column", "Write the sum of the amount column of /workspace/sales.csv into "
                    "/workspace/total.txt (just the number).",
                    files={"sales.csv": text.encode()}, answer={"number": sum(amounts)})


def _largest_file(rng: random.Random) -> TaskSpec:
    n = rng.randint(5, 9)
    sizes = rng.sample(range(10, 5000), n)            # distinct: exactly one largest
    names = rng.sample(["alpha", "bravo", "delta", "echo", "golf", "hotel", "india", "kilo", "lima", "mike",
                        "oscar", "papa", "romeo", "tango"], n)
    files = {f"files/{nm}.{rng.choice(['log', 'txt', 'dat'])}": bytes(rng.getrandbits(8) for _ in range(sz))
             for nm, sz in zip(names, sizes)}
    largest = max(files, key=lambda k: len(files[k])).split("/", 1)[1]
    return TaskSpec("largest_file", "Write the name of the largest file in /workspace/files/ into "
                    "/workspace/largest.txt (just the file name).", files=files, answer={"text": largest})


BUILDERS = {"hello": _hello, "count_lines": _count_lines, "sum_column": _sum_column, "largest_file": _largest_file}
TASKS = tuple(BUILDERS)
ANSWER_FILES = {"hello": "hello.txt", "count_lines": "count.txt", "sum_column": "total.txt",
                "largest_file": "largest.txt"}


def build(name: str, seed: int) -> TaskSpec:
    if name not in BUILDERS:
        raise ValueError(f"unknown terminal task {name!r}; tasks are {list(TASKS)}")
    return BUILDERS[name](random.Random(f"terminal/{name}/{seed}"))


def seed_files(workspace: pathlib.Path, spec: TaskSpec) -> None:
    """Write the task's input files into an empty workspace (through O_NOFOLLOW directory fds: never where a link
    the sandbox made points, envd/workspace_archive.write_new)."""
    for rel, data in spec.files.items():
        write_new(workspace, rel, data)


def read_top_level(workspace: pathlib.Path, name: str, limit: int = MAX_READ) -> bytes | None:
    """The first `limit` bytes of workspace/name if it is a regular file (no symlink, FIFO or device), else None."""
    if "/" in name or name in ("", ".", ".."):
        raise ValueError(f"not a top-level file name: {name!r}")
    try:
        dfd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
    except OSError:
        return None
    finally:
        os.close(dfd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, limit)
    finally:
        os.close(fd)


def verify(name: str, workspace: pathlib.Path, answer: dict) -> tuple[bool, str]:
    """(passed, why) for the task `name` against the workspace as it is now."""
    fname = ANSWER_FILES[name]
    data = read_top_level(workspace, fname)
    if data is None:
        return False, f"{fname} is missing (or not a regular file)"
    text = data.decode("utf-8", errors="replace").strip()
    if "number" in answer:
        try:
            got = int(text)
        except ValueError:
            return False, f"{fname} holds {text[:40]!r}, not a number"
        return (got == answer["number"]), f"{fname} holds {got}"
    return (text == answer["text"]), f"{fname} holds {text[:40]!r}"
