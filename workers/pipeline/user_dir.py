"""A user's own directory in node-shared memory (workers/pipeline/segment.py keeps the node's copy of the
weights there): `/dev/shm/fleetgen-UID`, or under FLEETGEN_SHM_DIR. Shared memory is world-writable, like
/tmp, so the directory is created mode 0700, opened once without following a link, and used only when
`fstat` says it is a directory of this user's with mode 0700; every file in it is opened relative to that
open directory, `O_NOFOLLOW`, and used only when it is a regular file of this user's that others cannot
read or write. Whatever fails a check is `Unavailable`, naming why: the caller falls back with one line."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

PREFIX = "fleetgen-"
PRIVATE_HINT = "set FLEETGEN_SHM_DIR to a directory only you can write, or pass --host-copy worker"
OPEN = os.O_NOFOLLOW | os.O_CLOEXEC


def shm_dir() -> Path:
    """The node-shared directory that holds each user's directory of segments."""
    return Path(os.environ.get("FLEETGEN_SHM_DIR", "/dev/shm"))


class Unavailable(Exception):
    """The node cannot hold a shared copy here (the reason is the message); the worker keeps its own."""


class UserDir:
    """This user's directory of segments in `base`, opened once (not following a link) and checked
    (`fstat`: a directory of this user's, mode 0700); its files are opened relative to it, never by a
    path another user could redirect. Unavailable, naming why, where it cannot be trusted."""

    def __init__(self, base: Path | None = None):
        base = base or shm_dir()
        self.path = base / f"{PREFIX}{os.geteuid()}"
        if not base.is_dir():
            raise Unavailable(f"{base} is missing or not writable")
        try:
            os.mkdir(self.path, 0o700)
        except FileExistsError:
            pass
        except OSError as err:
            raise Unavailable(f"{base} is missing or not writable ({err.strerror})") from None
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | OPEN)
        except OSError as err:  # ELOOP: a link in its place; ENOTDIR: a file
            raise Unavailable(f"{self.path} is not a directory of this user's ({err.strerror})") from None
        why = _not_mine(os.fstat(self.fd), 0o700, "directory")
        if why:
            os.close(self.fd)
            raise Unavailable(f"{self.path} {why}")

    def open(self, name: str, flags: int, what: str = "file") -> int:
        """A file of this directory, not following a link; Unavailable where it is not this user's own."""
        try:
            fd = os.open(name, flags | OPEN, 0o600, dir_fd=self.fd)
        except OSError as err:
            raise Unavailable(f"cannot open {self.path / name}: {err.strerror}") from None
        why = _not_mine(os.fstat(fd), None, what)
        if why:
            os.close(fd)
            raise Unavailable(f"{self.path / name} {why}")
        return fd

    def remove(self, *names: str) -> None:
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=self.fd)

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _not_mine(st: os.stat_result, mode: int | None, what: str) -> str | None:
    """Why a file or directory is not this user's own (None: it is)."""
    kind = stat.S_ISDIR if what == "directory" else stat.S_ISREG
    if not kind(st.st_mode):
        return f"is not a {'directory' if what == 'directory' else 'regular file'}"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if mode is not None and stat.S_IMODE(st.st_mode) != mode:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}, not {mode:04o}"
    if mode is None and stat.S_IMODE(st.st_mode) & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}: others may read or write it"
    return None


def read_all(fd: int) -> bytes:
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 20, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def segment_files(key: str) -> dict[str, str]:
    """The files of the segment `key` (workers/pipeline/segment.py says what each holds)."""
    return {k: f"{PREFIX}{key}.{k}" for k in ("lock", "users", "data", "json")}


def seals(home: UserDir, key: str) -> list[str]:
    """The seals of segment `key` being written, or left by dead writers."""
    return [n for n in home.names() if n.startswith(f"{segment_files(key)['json']}.tmp-")]


def reclaim(home: UserDir | Path | None = None, skip: str | None = None) -> list[str]:
    """Remove every segment of this user's directory (`home`, or the one in the node-shared directory `home`
    names, by default FLEETGEN_SHM_DIR's or /dev/shm's) that no live process uses (its users all died, or a
    job was killed); those another worker is busy with are left alone. The keys removed; none where this
    user has no directory it can trust. (Here, not beside the segment: a driver's reclaim task on each node
    imports no torch.)"""
    import fcntl

    own = not isinstance(home, UserDir)
    if own:
        try:
            home = UserDir(home)
        except Unavailable:
            return []
    removed = []
    try:
        for name in home.names():
            if not (name.startswith(PREFIX) and name.endswith(".users")):
                continue
            key = name[len(PREFIX) : -len(".users")]
            if key == skip:
                continue
            files = segment_files(key)
            try:
                lock = home.open(files["lock"], os.O_RDWR | os.O_CREAT)
            except Unavailable:
                continue
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fd = home.open(name, os.O_RDWR)
            except (BlockingIOError, Unavailable):
                os.close(lock)
                continue  # being written, joined or left right now: live (or gone meanwhile)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                home.remove(*(files[k] for k in ("json", "data", "users", "lock")), *seals(home, key))
                removed.append(key)
            except BlockingIOError:
                pass
            finally:
                os.close(fd)
                os.close(lock)
    finally:
        if own:
            home.close()
    return removed
