"""Workspace snapshots as plain tar archives (gzip), with a JSON metadata member; no pickle anywhere.

Archives come back from clients in Restore, so `unpack` treats them as hostile: members must be `meta.json` or lie
under `workspace/`; no absolute names, no `..`, no hard links, devices or FIFOs; symlinks only with relative targets
that stay inside the workspace (checked again on the extracted tree, where chains of links could escape); sizes and
member counts are capped before anything is written; every path is created through directory fds with O_NOFOLLOW,
so no member can be written through a symlink, whatever the links say.

`pack` walks the workspace with fd-based `os.fwalk` and opens files with O_NOFOLLOW, so a workspace whose contents
change under it (or that holds links to host files) can only ever put workspace bytes into a snapshot.

`clear_dir` / `rmtree` empty or remove a workspace the sandbox wrote into, whatever permissions it left behind.
"""
from __future__ import annotations

import io
import json
import os
import pathlib
import posixpath
import shutil
import stat
import tarfile
import zlib

from envd.base import ActionError

META = "meta.json"
ROOT = "workspace"
MAX_BYTES = 256 << 20      # total file bytes in one archive (a snapshot counts its names and link targets too)
MAX_MEMBERS = 20_000
MAX_META_BYTES = 4 << 20
MAX_DEPTH = 256            # directories below the workspace: a walk of the tree recurses once per level


def pack(workspace: pathlib.Path, meta: dict, max_bytes: int = MAX_BYTES) -> bytes:
    """A gzip'd tar of meta (as JSON) and the workspace tree: regular files, directories and symlinks."""
    buf = io.BytesIO()
    total = members = 0
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT, compresslevel=6) as tar:
        data = json.dumps(meta).encode()
        _add_bytes(tar, META, data)
        root_fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for dirpath, dirnames, filenames, dfd in _walk(root_fd):
                rel_dir = posixpath.normpath(posixpath.join(ROOT, dirpath))
                dirnames.sort()
                for name in sorted(dirnames + filenames):
                    members += 1
                    if members > MAX_MEMBERS:
                        raise ActionError(f"the workspace has more than {MAX_MEMBERS} entries to snapshot")
                    # Names count too: 20,000 members 256 directories of 255-byte names deep are ~1.3 GB of
                    # headers, of a workspace of empty files.
                    arcname = f"{rel_dir}/{name}"
                    total += len(arcname.encode(errors="surrogateescape"))
                    total += _add_entry(tar, dfd, name, arcname, max_bytes - total)
                    if total > max_bytes:
                        raise ActionError(f"the workspace's names, links and files take more than {max_bytes} "
                                          "bytes: too big to snapshot")
        finally:
            os.close(root_fd)
    return buf.getvalue()


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    tar.addfile(info, io.BytesIO(data))


def _walk(root_fd: int):
    """os.fwalk from root_fd, never following links, as deep as MAX_DEPTH (deeper: ActionError, where os.fwalk's
    recursion would raise RecursionError)."""
    for dirpath, dirnames, filenames, dfd in os.fwalk(".", dir_fd=root_fd, follow_symlinks=False):
        if dirpath.count("/") >= MAX_DEPTH and (dirnames or filenames):  # entries at MAX_DEPTH + 1: not restorable
            raise ActionError(f"the workspace is nested deeper than {MAX_DEPTH} directories: too deep to snapshot")
        yield dirpath, dirnames, filenames, dfd


def _add_entry(tar: tarfile.TarFile, dfd: int, name: str, arcname: str, room: int) -> int:
    """Add one entry; room: the bytes the snapshot may still take (a file larger is refused before it is read: a
    sparse file of 1.5 GB passes the disk quota with no blocks at all)."""
    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    info = tarfile.TarInfo(arcname)
    info.mode, info.mtime = stat.S_IMODE(st.st_mode), int(st.st_mtime)
    if stat.S_ISDIR(st.st_mode):
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
        return 0
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(name, dir_fd=dfd)
        if target == "/" + ROOT or target.startswith(f"/{ROOT}/"):
            # Absolute inside the sandbox (/workspace/...): stored relative, so it means the same after a restore.
            target = posixpath.relpath(target[1:], posixpath.dirname(arcname))
        _check_link(arcname, target)   # a link out of the workspace could not be restored: say so now
        info.type, info.linkname = tarfile.SYMTYPE, target
        tar.addfile(info)
        return len(target.encode(errors="surrogateescape"))
    if not stat.S_ISREG(st.st_mode):
        return 0  # FIFOs, sockets, devices: not workspace content
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
    except OSError:
        return 0  # replaced or removed while we walked
    with os.fdopen(fd, "rb") as f:
        fst = os.fstat(fd)
        if not stat.S_ISREG(fst.st_mode):
            return 0
        if fst.st_size > room:
            raise ActionError(f"the workspace holds more bytes than a snapshot may ({arcname!r}: {fst.st_size} "
                              f"bytes, {max(room, 0)} left of the limit): too big to snapshot")
        data = f.read(fst.st_size)   # a snapshot of the bytes now, whatever the file does next
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    return len(data)


def _check_name(name: str) -> str:
    if not name or name.startswith("/") or "\\" in name or "\x00" in name:
        raise ActionError(f"bad archive member name {name!r}")
    parts = name.rstrip("/").split("/")
    if any(p in ("..", "") for p in parts):
        raise ActionError(f"archive member {name!r} has an empty or '..' component")
    norm = "/".join(p for p in parts if p != ".")
    if norm != META and norm != ROOT and not norm.startswith(ROOT + "/"):
        raise ActionError(f"archive member {name!r} is outside {ROOT}/")
    return norm


def _check_link(name: str, target: str) -> None:
    if not target or target.startswith("/") or "\x00" in target:
        raise ActionError(f"symlink {name!r} -> {target!r} points outside the workspace (only relative targets "
                          "are allowed)")
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(name), target))
    if resolved != ROOT and not resolved.startswith(ROOT + "/"):
        raise ActionError(f"symlink {name!r} -> {target!r} points outside the workspace")


def unpack(data: bytes, dest: pathlib.Path, max_bytes: int = MAX_BYTES) -> dict:
    """Validate the archive, then extract its workspace into the empty directory `dest`; returns the metadata.

    Two passes: every header is checked before the first byte is written (a bad archive leaves `dest` empty), then
    the members are streamed out, so memory stays small whatever the archive holds."""
    try:
        meta = _validate(data, max_bytes)
        _extract(data, dest)
    except (tarfile.TarError, EOFError, OSError, zlib.error, ValueError) as e:  # json errors are ValueErrors
        if isinstance(e, ActionError):
            raise
        raise ActionError(f"not a valid workspace archive: {type(e).__name__}: {e}") from None
    _check_extracted_links(dest)
    return meta


def _validate(data: bytes, max_bytes: int) -> dict:
    meta, seen, total = None, set(), 0
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        while (m := tar.next()) is not None:
            if len(seen) >= MAX_MEMBERS:
                raise ActionError(f"the archive has more than {MAX_MEMBERS} members")
            name = _check_name(m.name)
            if name in seen:
                raise ActionError(f"archive member {name!r} appears twice")
            if name.count("/") > MAX_DEPTH:
                raise ActionError(f"archive member {name[:80]!r}... is nested deeper than {MAX_DEPTH} directories")
            seen.add(name)
            if name == META:
                if not m.isreg() or m.size > MAX_META_BYTES:
                    raise ActionError(f"{META} must be a regular file under {MAX_META_BYTES} bytes")
                meta = json.loads(tar.extractfile(m).read())
            elif m.isreg():
                total += m.size
                if total > max_bytes:
                    raise ActionError(f"the archive unpacks to more than {max_bytes} bytes")
            elif m.issym():
                _check_link(name, m.linkname)
            elif not m.isdir():
                raise ActionError(f"archive member {name!r} is a {_kind(m)}: only files, directories and "
                                  "symlinks are allowed")
    if not isinstance(meta, dict):
        raise ActionError(f"the archive has no {META} object")
    return meta


def _kind(m: tarfile.TarInfo) -> str:
    return {tarfile.LNKTYPE: "hard link", tarfile.CHRTYPE: "character device", tarfile.BLKTYPE: "block device",
            tarfile.FIFOTYPE: "FIFO"}.get(m.type, f"member of type {m.type!r}")


def _open_dir(root_fd: int, parts: list[str]) -> int:
    """An fd of root/parts..., creating directories, never following a symlink (ELOOP/ENOTDIR -> ActionError)."""
    fd = os.dup(root_fd)
    try:
        for p in parts:
            try:
                os.mkdir(p, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            nfd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nfd
        return fd
    except OSError as e:
        os.close(fd)
        raise ActionError(f"archive path {'/'.join(parts)!r} goes through a non-directory: {e.strerror}") from None


def write_new(root: pathlib.Path, rel: str, data: bytes) -> None:
    """Write root/rel holding `data`, its directories too, through O_NOFOLLOW directory fds: never through a symlink,
    whatever the workspace holds. An existing file or link there is replaced (unlinked, then created with O_EXCL); a
    directory there is an ActionError."""
    parts = _check_name(f"{ROOT}/{rel}").split("/")[1:]
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        parent = _open_dir(root_fd, parts[:-1])
    finally:
        os.close(root_fd)
    try:
        try:
            os.unlink(parts[-1], dir_fd=parent)  # a file or a link (never followed); a directory raises
        except FileNotFoundError:
            pass
        fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=parent)
    except OSError as e:
        raise ActionError(f"cannot create {rel!r} in the workspace: {e.strerror}") from None
    finally:
        os.close(parent)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _extract(data: bytes, dest: pathlib.Path) -> None:
    """Write the (validated) workspace members under `dest` through O_NOFOLLOW directory fds."""
    root_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    dir_modes = []
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            while (m := tar.next()) is not None:
                name = _check_name(m.name)
                parts = name.split("/")[1:]       # drop the leading "workspace"
                if name == META or not parts:
                    continue
                parent = _open_dir(root_fd, parts[:-1])
                try:
                    if m.isdir():
                        os.close(_open_dir(parent, parts[-1:]))
                        dir_modes.append((parts, m.mode))
                    elif m.issym():
                        os.symlink(m.linkname, parts[-1], dir_fd=parent)
                    else:
                        fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                                     (m.mode & 0o777) | 0o600, dir_fd=parent)
                        with os.fdopen(fd, "wb") as f:
                            shutil.copyfileobj(tar.extractfile(m), f, 1 << 20)
                except FileExistsError:
                    raise ActionError(f"archive member {name!r} collides with an earlier one") from None
                finally:
                    os.close(parent)
        for parts, mode in dir_modes:   # after the files went in, so a read-only directory does not block them
            fd = _open_dir(root_fd, parts)
            try:
                os.chmod(fd, (mode & 0o777) | 0o700)
            finally:
                os.close(fd)
    finally:
        os.close(root_fd)


def _check_extracted_links(dest: pathlib.Path) -> None:
    """Chains of individually-inside links can still resolve outside; check their real resolution."""
    root = os.path.realpath(dest)
    for dirpath, dirnames, filenames in os.walk(dest, followlinks=False):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                real = os.path.realpath(p)
                if real != root and not real.startswith(root + os.sep):
                    raise ActionError(f"symlink {os.path.relpath(p, dest)!r} resolves outside the workspace")


def clear_dir(d: pathlib.Path) -> None:
    """Empty a directory the sandbox wrote into (it may have made subdirectories unreadable or unwritable)."""
    for entry in os.scandir(d):
        p = pathlib.Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            rmtree(p)
        else:
            p.unlink(missing_ok=True)


def rmtree(p: pathlib.Path) -> None:
    """Remove a tree the sandbox wrote into, whatever permissions it left on it and however deep it is: iteratively,
    one directory fd at a time, never following a link (shutil.rmtree and os.fwalk recurse: a chain of 1,500
    directories raised RecursionError, and the workspace stayed on disk for good)."""
    p = pathlib.Path(p)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        p.unlink(missing_ok=True)
        return
    fd = _enter(os.open(p.parent, os.O_RDONLY | os.O_DIRECTORY), p.name)
    names = [p.name]          # the path from p's parent down to the directory fd is open on
    while fd is not None:
        sub = None
        with os.scandir(fd) as it:  # files go as they are met; the first subdirectory is entered (a directory we
            for e in it:            # come back to holds only subdirectories, so its scan stops at once)
                if e.is_dir(follow_symlinks=False):
                    sub = e.name
                    break
                try:
                    os.unlink(e.name, dir_fd=fd)
                except FileNotFoundError:
                    pass
        if sub is not None:  # down one level
            fd = _enter(fd, sub)
            names.append(sub)
            continue
        up = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)   # empty now: up one level and remove it
        os.close(fd)
        try:
            os.rmdir(names.pop(), dir_fd=up)
        except FileNotFoundError:
            pass
        if names:
            fd = up
        else:
            os.close(up)
            fd = None


def _enter(parent: int, name: str) -> int:
    """An fd of the directory `name` in `parent` (closed here), made readable and writable by us first: the sandbox
    may have chmod 000'ed it. Never through a link (O_NOFOLLOW)."""
    try:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
        except PermissionError:
            os.chmod(name, 0o700, dir_fd=parent)  # lstat'ed as a directory above: no link to follow here
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
    finally:
        os.close(parent)
    try:
        os.chmod(fd, 0o700)
    except OSError:
        pass
    return fd
