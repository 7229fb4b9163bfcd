"""Shared-memory files at run time, for both sides: which directory, creating a file under this process's
liveness lock (an flock the kernel drops when the process dies, SIGKILL included, seen across PID
namespaces), and sweeping away what dead instances left behind."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from protos.shm import LOCK_ROLE, NAME

log = logging.getLogger(__name__)

DEFAULT_SHM_DIR = "/dev/shm"
SHM_DIR_ENV = "ENCODER_SHM_DIR"


def shm_dir() -> Path:
    """Where segments and probes live, read when asked: $ENCODER_SHM_DIR, else /dev/shm.

    Both sides must see the same directory: /dev/shm on a host, or a memory-backed emptyDir mounted
    there (or at $ENCODER_SHM_DIR) in both containers of a pod.
    """
    return Path(os.environ.get(SHM_DIR_ENV) or DEFAULT_SHM_DIR)


def create_locked(path: Path, content: bytes = b"") -> int:
    """Creates `path` (0600) holding `content`, with this process's flock on it; returns the fd.

    The file is written and locked while it has no name (O_TMPFILE) and only then linked in, so no
    sweep can ever find it unlocked or half written.
    """
    if not hasattr(os, "O_TMPFILE"):
        raise OSError(errno.ENOTSUP, f"no O_TMPFILE on {os.uname().sysname}")
    fd = os.open(path.parent, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    directory = None
    try:
        os.fchmod(fd, 0o600)
        if content:
            os.pwrite(fd, content, 0)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # A directory fd makes os.link call linkat(AT_SYMLINK_FOLLOW), which links the inode behind
        # the /proc fd link; a plain link() would try to link the /proc entry itself.
        directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        os.link(f"/proc/self/fd/{fd}", path.name, dst_dir_fd=directory, follow_symlinks=True)
    except BaseException:
        os.close(fd)
        raise
    finally:
        if directory is not None:
            os.close(directory)
    return fd


def sweep_stale(directory: Path) -> list[str]:
    """Removes every file of dead encoder and receiver instances in `directory`; returns the names."""
    return sweep_instances(directory, NAME, lambda instance: f"{instance}.{LOCK_ROLE[instance.split('.', 1)[0]]}")


def sweep_instances(directory: Path, name: re.Pattern[str], lock_name_of: Callable[[str], str]) -> list[str]:
    """Removes every file of dead instances (their lock is free) in `directory`; returns the names.

    `name` matches an instance's files, with the instance id as group "instance"; `lock_name_of`
    names the file whose flock the instance holds while it lives. Files of live instances, of other
    users and of no instance are left alone.
    """
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    by_instance: dict[str, list[str]] = defaultdict(list)
    for file_name in names:
        match = name.fullmatch(file_name)
        if match:
            by_instance[match["instance"]].append(file_name)
    removed: list[str] = []
    for instance, files in by_instance.items():
        lock_name = lock_name_of(instance)
        if lock_name not in files:
            continue  # no lock to judge by: not ours to remove
        try:
            fd = os.open(directory / lock_name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # gone meanwhile, or another user's
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    continue  # its owner is alive (or another sweep is removing it)
                raise
            # The lock goes last, so a sweep cut short leaves it behind for the next one to finish.
            for file_name in sorted(files, key=lambda n: n == lock_name):
                try:
                    os.unlink(directory / file_name)
                    removed.append(file_name)
                except FileNotFoundError:
                    pass
        except OSError as exc:
            log.warning("could not remove stale shared-memory files of %s: %s", instance, exc)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d stale shared-memory files of dead processes", len(removed))
    return removed
