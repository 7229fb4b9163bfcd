"""The same-host fast path's contract, used by both sides: file names under /dev/shm, the segment
header, the proof that a server shares the receiver's memory, and the liveness locks that let
either side remove what a dead process left behind.

Every file is owner-only (0600) and carries a 128-bit random instance id and, for segments, a
128-bit random name, so another user can neither read nor guess one. A process holds an flock on
its instance's lock file (the server's `.lock`, the receiver's `.probe`) for its whole life; the
kernel drops it when the process dies, SIGKILL included, which is how a sweep tells dead instances
from live ones across PID namespaces (containers sharing one memory-backed volume).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import logging
import os
import re
import secrets
import struct
from collections import defaultdict
from pathlib import Path

from protos import encoder_pb2 as pb

log = logging.getLogger(__name__)

# Both sides must see the same directory: /dev/shm on a host, or a memory-backed emptyDir mounted
# there (or at $ENCODER_SHM_DIR) in both containers of a pod.
SHM_DIR = Path(os.environ.get("ENCODER_SHM_DIR", "/dev/shm"))

TOKEN_BYTES = 32
HEADER_BYTES = 128  # the payload starts here: a cache-line multiple, so it stays aligned for any dtype
_MAGIC = b"ENCSHM01"
# magic, payload_bytes, index, num_tokens, hidden_size, dtype, num_deepstack_layers, proof
_HEADER = struct.Struct("<8sQIIIII32s")

SERVER_KIND = "encsrv"
RECEIVER_KIND = "encrx"
_HEX = "[0-9a-f]{32}"
# <kind>.<pid>.<instance>.<role>: pid for people reading `ls /dev/shm`, the instance id for safety.
_NAME = re.compile(
    rf"(?P<instance>(?:{SERVER_KIND}|{RECEIVER_KIND})\.\d+\.{_HEX})\.(?P<role>lock|probe|pool\.{_HEX}|seg\.{_HEX})"
)
_LOCK_ROLE = {SERVER_KIND: "lock", RECEIVER_KIND: "probe"}


def new_instance(kind: str) -> str:
    """A fresh instance id: `<kind>.<pid>.<128 random bits>`."""
    return f"{kind}.{os.getpid()}.{secrets.token_hex(16)}"


def random_name(instance: str, role: str) -> str:
    """An unguessable file name of the instance: `<instance>.<role>.<128 random bits>`."""
    return f"{instance}.{role}.{secrets.token_hex(16)}"


def _role(name: str) -> str | None:
    match = _NAME.fullmatch(name)
    return match["role"] if match else None


def is_probe_name(name: str) -> bool:
    """A receiver's probe name, and nothing else: servers open only names that pass this."""
    return name.startswith(RECEIVER_KIND + ".") and _role(name) == "probe"


def is_segment_name(name: str) -> bool:
    """A server's announced segment name: receivers open and unlink only names that pass this."""
    role = _role(name)
    return name.startswith(SERVER_KIND + ".") and role is not None and role.startswith("seg.")


def item_proof(token: bytes, request_id: str, index: int, segment: str, payload_bytes: int) -> bytes:
    """HMAC-SHA256 keyed by the probe's token over what the stream announces for one item."""
    message = f"encoder.v1 shm|{request_id}|{index}|{segment}|{payload_bytes}".encode()
    return hmac.new(token, message, hashlib.sha256).digest()


def segment_header(header: pb.ItemHeader, proof: bytes) -> bytes:
    """The first HEADER_BYTES of a segment: what the stream's ItemHeader says, and its proof."""
    packed = _HEADER.pack(
        _MAGIC,
        header.payload_bytes,
        header.index,
        header.num_tokens,
        header.hidden_size,
        header.dtype,
        header.num_deepstack_layers,
        proof,
    )
    return packed.ljust(HEADER_BYTES, b"\0")


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


def sweep_stale(directory: Path | None = None) -> list[str]:
    """Removes every file of dead instances (their lock is free) in `directory`; returns the names.

    Files of live instances, of other users and of no instance of ours are left alone.
    """
    directory = directory or SHM_DIR
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    by_instance: dict[str, list[str]] = defaultdict(list)
    for name in names:
        match = _NAME.fullmatch(name)
        if match:
            by_instance[match["instance"]].append(name)
    removed: list[str] = []
    for instance, files in by_instance.items():
        lock_name = f"{instance}.{_LOCK_ROLE[instance.split('.', 1)[0]]}"
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
            for name in sorted(files, key=lambda n: n == lock_name):
                try:
                    os.unlink(directory / name)
                    removed.append(name)
                except FileNotFoundError:
                    pass
        except OSError as exc:
            log.warning("could not remove stale shared-memory files of %s: %s", instance, exc)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d stale shared-memory files of dead encoder processes", len(removed))
    return removed
