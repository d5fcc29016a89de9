"""A structural check of a Dockerfile against its build context, for machines without docker or hadolint.

`problems(dockerfile, context, script=...)` returns what is wrong, one line each (empty = fine):
- every COPY/ADD source (without --from) exists in the build context and is not left out by the context's
  .dockerignore (Docker's rules: patterns in order, the last match wins, `!` lets a path back in, a pattern that
  matches a folder covers everything under it, `**` spans folders);
- every base image is pinned to a tag or a digest, and the tag is not `latest` (earlier stages and `scratch` aside;
  ARG defaults declared before the first FROM are substituted);
- the final stage runs as a USER that is not root;
- the final stage's ENTRYPOINT, in exec form, is the console script `script` of the venv a RUN creates with
  `python -m venv DIR` (DIR/bin/script, where pip puts the scripts of pyproject.toml's [project.scripts]).
`build_commands(text)` finds `docker build -f FILE -t NAME CONTEXT` commands in a text (docs, comments).
"""
from __future__ import annotations

import json
import pathlib
import re
import shlex


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, backslash continuations joined."""
    out, buf = [], ""
    for line in text.splitlines():
        s = line.strip()
        if not buf and (not s or s.startswith("#")):
            continue
        if buf and s.startswith("#"):  # a comment inside a continued instruction is skipped
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        buf += s
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    if buf.strip():
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _flags(args: str) -> tuple[dict[str, str], list[str]]:
    """--flag=value options and the remaining words (JSON array form or shell words)."""
    flags = {}
    words = json.loads(args) if args.startswith("[") else shlex.split(args)
    rest = []
    for w in words:
        if not rest and w.startswith("--"):
            k, _, v = w[2:].partition("=")
            flags[k] = v
        else:
            rest.append(w)
    return flags, rest


def _pattern_regex(pattern: str) -> re.Pattern:
    """A .dockerignore pattern (Go filepath.Match plus `**`) as a regex over /-separated relative paths."""
    i, out = 0, ""
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):  # `**/` = zero or more folders
                out += "(?:.*/)?"
                i += 1
            else:
                out += ".*"
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            j = pattern.find("]", i)
            if j < 0:
                out += re.escape(c)
            else:
                cls = pattern[i + 1:j]
                out += "[" + ("^" + cls[1:] if cls.startswith("^") else cls) + "]"
                i = j
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + r"\Z")


class DockerIgnore:
    def __init__(self, text: str):
        self.rules: list[tuple[bool, re.Pattern]] = []
        for line in text.splitlines():
            s = line.strip()
            if not s or s.startswith("#"):
                continue
            negate = s.startswith("!")
            s = s[1:].strip() if negate else s
            s = re.sub(r"/+", "/", s).strip("/")
            s = re.sub(r"(^|/)\./", r"\1", s)
            if s:
                self.rules.append((negate, _pattern_regex(s)))

    def excluded(self, rel: str) -> bool:
        """Whether the context path `rel` (a file or folder, /-separated) is left out of the build context."""
        parts = rel.strip("/").split("/")
        prefixes = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
        out = False
        for negate, rx in self.rules:
            if any(rx.match(p) for p in prefixes):
                out = not negate
        return out


def _context_files(context: pathlib.Path, ignore: DockerIgnore, source: str) -> list[str]:
    """The context files a COPY source brings in (after .dockerignore); a folder brings its files."""
    src = source.strip("/")
    src = "" if src in ("", ".") else src
    matches = [context] if not src else sorted(context.glob(src)) if any(c in src for c in "*?[") else (
        [context / src] if (context / src).exists() else [])
    files = []
    for m in matches:
        for f in ([m] if m.is_file() else sorted(p for p in m.rglob("*") if p.is_file())):
            rel = f.relative_to(context).as_posix()
            if not ignore.excluded(rel):
                files.append(rel)
    return files


def problems(dockerfile: pathlib.Path, context: pathlib.Path, script: str = "tars") -> list[str]:
    text = dockerfile.read_text()
    ins = instructions(text)
    ignore_file = context / ".dockerignore"
    ignore = DockerIgnore(ignore_file.read_text() if ignore_file.exists() else "")
    out: list[str] = []
    global_args: dict[str, str] = {}
    stages: list[dict] = []
    for word, args in ins:
        if word == "ARG" and not stages:
            k, _, v = args.partition("=")
            global_args[k.strip()] = v.strip().strip('"')
        elif word == "FROM":
            _, rest = _flags(args)
            image = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: global_args.get(m.group(1), m.group(0)),
                           rest[0])
            name = rest[2] if len(rest) >= 3 and rest[1].upper() == "AS" else None
            known = {s["name"] for s in stages if s["name"]}
            if "$" in image:
                out.append(f"FROM {rest[0]}: an ARG without a default")
            elif image != "scratch" and image not in known:
                last = image.rsplit("/", 1)[-1]
                if "@sha256:" in image:
                    pass
                elif ":" not in last:
                    out.append(f"FROM {image}: base image not pinned to a tag or digest")
                elif last.rsplit(":", 1)[1] == "latest":
                    out.append(f"FROM {image}: the `latest` tag is not a pin")
            stages.append({"name": name, "user": None, "entrypoint": None, "venvs": []})
        elif not stages:
            continue
        elif word in ("COPY", "ADD"):
            flags, words = _flags(args)
            if "from" in flags:
                continue
            if len(words) < 2:
                out.append(f"{word} {args}: needs a source and a destination")
                continue
            for src in words[:-1]:
                if word == "ADD" and re.match(r"[a-z]+://", src):
                    out.append(f"ADD {src}: a remote source is not pinned by the build context")
                elif not _context_files(context, ignore, src):
                    why = "is left out by .dockerignore" if (context / src).exists() else "does not exist"
                    out.append(f"{word} {src}: {why} in the build context {context}")
        elif word == "USER":
            stages[-1]["user"] = args.split(":", 1)[0].strip()
        elif word == "ENTRYPOINT":
            stages[-1]["entrypoint"] = json.loads(args) if args.startswith("[") else None
            if not args.startswith("["):
                out.append("ENTRYPOINT in shell form: signals do not reach the process (use the JSON form)")
        elif word == "RUN":
            stages[-1]["venvs"] += re.findall(r"-m\s+venv\s+(?:--\S+\s+)*(/\S+)", args)
    if not stages:
        return out + ["no FROM"]
    final = stages[-1]
    if final["user"] in (None, "", "root", "0"):
        out.append(f"final stage runs as root (USER {final['user'] or 'missing'})")
    venvs = [v.rstrip("/") for s in stages for v in s["venvs"]]
    ep = final["entrypoint"]
    if ep is None:
        if not any("ENTRYPOINT in shell form" in p for p in out):
            out.append("final stage has no ENTRYPOINT")
    elif not venvs:
        out.append("no RUN creates a venv (python -m venv DIR): the entrypoint cannot be the console script")
    elif ep[0] not in {f"{v}/bin/{script}" for v in venvs}:
        out.append(f"ENTRYPOINT {ep}: not the console script {script!r} of the venv ({venvs[0]}/bin/{script})")
    return out


def build_commands(text: str) -> list[dict]:
    """`docker build ... -f FILE ... -t NAME ... CONTEXT` commands in a text: [{file, tags, context}]."""
    out = []
    for m in re.finditer(r"docker build((?:[ \t]+[^\s`]+)+)", text):
        words = shlex.split(m.group(1), comments=True)
        cmd = {"file": "Dockerfile", "tags": [], "context": None}
        i = 0
        while i < len(words):
            w = words[i]
            if w in ("-f", "--file", "-t", "--tag") and i + 1 == len(words):
                raise ValueError(f"docker build command ends at {w}: {m.group(0)!r} (keep it on one line)")
            if w in ("-f", "--file"):
                cmd["file"] = words[i + 1]
                i += 2
            elif w in ("-t", "--tag"):
                cmd["tags"].append(words[i + 1])
                i += 2
            elif w.startswith("-"):
                i += 2 if w in ("--build-arg", "--target", "--platform") else 1
            else:
                cmd["context"] = w
                i += 1
        out.append(cmd)
    return out
