"""Folders and files only their owner can write: what the caches that load compiled code
(the CPU kernel, the XLA compilation cache) require before they read anything back."""

from __future__ import annotations

import os
import stat
from pathlib import Path


class NotPrivateError(Exception):
    """`path` (a "file" or "directory") could be written by another user: `problem` says how."""

    def __init__(self, path: Path, kind: str, problem: str):
        super().__init__(f"{kind} {path} {problem}")
        self.path, self.kind, self.problem = path, kind, problem


def make_private_directory(directory: Path) -> None:
    """Creates `directory` (mode 0700) if needed; raises NotPrivateError if another user
    could write it or a directory above it (and so put a file in it)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    real = directory.resolve()
    for path in (real, *real.parents):
        check_private(path, path.stat(), "directory")


def check_private(path: Path, info: os.stat_result, kind: str) -> None:
    """Raises NotPrivateError unless `path` belongs to this user (or, for directories,
    root) and no other user can write it: group- or world-writable is allowed only for a
    sticky directory (whose entries only their owners can replace) and group-writable for
    the user's private group. `info` is its `stat` (`lstat` for a file, so that a link is
    refused)."""
    uid = os.getuid()
    owner_ok = info.st_uid == uid or (kind == "directory" and info.st_uid == 0)
    if kind == "file" and not stat.S_ISREG(info.st_mode):
        problem = "is not a regular file"
    elif not owner_ok:
        problem = f"belongs to uid {info.st_uid}, not to you (uid {uid})"
    elif kind == "directory" and info.st_mode & stat.S_ISVTX:
        return
    elif info.st_mode & stat.S_IWOTH:
        problem = "is writable by every user"
    elif info.st_mode & stat.S_IWGRP and not private_group(info.st_gid, uid):
        problem = f"is writable by the members of group {info.st_gid}"
    else:
        return
    raise NotPrivateError(path, kind, problem)


def private_group(gid: int, uid: int) -> bool:
    """Whether group `gid` is the user's own (named after them, no other member)."""
    import grp  # POSIX only
    import pwd

    try:
        user = pwd.getpwuid(uid).pw_name
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    return group.gr_name == user and set(group.gr_mem) <= {user}


def user_cache_dir(name: str) -> Path:
    """`$XDG_CACHE_HOME/bam_jax/NAME`, else `~/.cache/bam_jax/NAME`."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "bam_jax" / name
