"""Files the agent (root on an instance) writes or reads in folders the job's user may write.

The job owns `checkpoints/`, `control/`, `output/` and its venv (bootstrap/jobuser.py gives them to it): it
can put a link at any name in them, or swap a folder for a link, at any moment. A plain `open()`, `touch()`
or `write_text()` by root follows such a link, so the job could make root create or truncate any file on
the instance (/etc/ld.so.preload, the agent's own code). Everything here opens the folder once with
O_DIRECTORY|O_NOFOLLOW and works relative to that descriptor, each name opened with O_NOFOLLOW, so a
planted link is never followed: a write replaces the link (rename replaces a name, it never follows it)
and says so in one line; a read refuses it.

Only the last component of `directory` is checked: the folders above it (scratch, the venv cache) are
root's own, which the job cannot change.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

# A descriptor's path through procfs: it names the folder the descriptor holds, whatever the job renames or
# replaces meanwhile (Linux; elsewhere there is no job user, and the plain path serves).
_PROC_FD = Path("/proc/self/fd")
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class PlantedLinkError(OSError):
    """A link (or something else than a regular file or folder) where the agent reads or writes."""


def outside_name(name: object) -> str | None:
    """Why `name` (a file name a manifest lists, relative to its folder) could leave that folder, or None.

    Absolute paths, `..` parts and empty names leave it (or name the folder itself); `.` parts and doubled
    slashes are harmless and pass."""
    if not isinstance(name, str) or not name or "\0" in name:
        return "not a file name"
    path = PurePosixPath(name)
    if path.is_absolute():
        return "an absolute path"
    if ".." in path.parts:
        return "a path through '..'"
    if not path.parts:
        return "the folder itself"
    return None


def _open_folder(name: str | Path, shown: str, dir_fd: int | None = None) -> int:
    """A descriptor of the folder `name` itself; a link (or a file) there raises PlantedLinkError."""
    try:
        return os.open(name, _DIRECTORY_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise PlantedLinkError(exc.errno, f"{shown}: not a folder (a link?); not followed") from None
        raise


@contextlib.contextmanager
def open_directory(directory: Path) -> Iterator[int]:
    """A descriptor of `directory` itself, never of what a link there points to (PlantedLinkError)."""
    fd = _open_folder(directory, str(directory))
    try:
        yield fd
    finally:
        os.close(fd)


def fd_path(fd: int, fallback: Path) -> Path:
    """A path that resolves to what `fd` holds, even after the job renamed it or put a link at its name:
    for APIs that take a file name (boto3's transfers). `fallback` where procfs is missing."""
    return _PROC_FD / str(fd) if _PROC_FD.is_dir() else fallback


def _link_target(fd: int, name: str) -> str | None:
    """Where the link at `name` points, or None when `name` is not a link (or is gone)."""
    try:
        return os.readlink(name, dir_fd=fd)
    except OSError:
        return None


def replace_file(
    path: Path,
    data: bytes = b"",
    *,
    mode: int = 0o644,
    durable: bool = True,
    say: Callable[[str], None] | None = None,
) -> None:
    """Put a regular file holding `data` at `path`, atomically (readers see the old or the new, never half).

    The bytes go to a fresh random name created with O_CREAT|O_EXCL|O_NOFOLLOW (the job cannot have
    prepared it), are fsynced (`durable`), and the name is renamed over `path`: a link the job planted at
    `path` is replaced, never followed, and `say` gets one line naming it. The new file is the writer's.
    Not `durable`: a signal file read live (a stop), which must not wait behind a checkpoint's writeback."""
    with open_directory(path.parent) as fd:
        planted = _link_target(fd, path.name)
        temporary = f".{path.name}.tmp-{secrets.token_hex(8)}"
        handle = os.open(
            temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd
        )
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(handle, view) :]
                os.fchmod(handle, mode)  # the umask must not narrow what readers (the job) need
                if durable:
                    os.fsync(handle)
            finally:
                os.close(handle)
            os.replace(temporary, path.name, src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=fd)
            raise
        if durable:
            os.fsync(fd)
    if planted is not None and say is not None:
        say(f"{path}: the job had put a link here (to {planted}); replaced by a regular file, not followed")


def open_inside(directory: Path, name: str) -> int:
    """A read-only descriptor of the regular file `name` under `directory`, or PlantedLinkError.

    Each folder on the way is opened with O_DIRECTORY|O_NOFOLLOW relative to the one above and the file with
    O_NOFOLLOW, so a link anywhere below `directory`, even one swapped in after any earlier check, is refused,
    never followed out of it."""
    why = outside_name(name)
    if why is not None:
        raise PlantedLinkError(errno.EPERM, f"{name!r}: {why}, outside {directory}")
    *folders, leaf = PurePosixPath(name).parts
    fd = _open_folder(directory, str(directory))
    where = directory
    try:
        for folder in folders:
            where = where / folder
            inner = _open_folder(folder, str(where), dir_fd=fd)
            os.close(fd)
            fd = inner
        try:
            handle = os.open(leaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise PlantedLinkError(exc.errno, f"{name!r} is a link, not followed") from None
            raise
    finally:
        os.close(fd)
    # O_NONBLOCK: a FIFO the job left there must not hang the agent's open; only a regular file is read.
    if not stat.S_ISREG(os.fstat(handle).st_mode):
        os.close(handle)
        raise PlantedLinkError(errno.EINVAL, f"{name!r} is not a regular file")
    os.set_blocking(handle, True)
    return handle


def remove_entry(path: Path, *, ignore_errors: bool = True) -> None:
    """Remove whatever is at `path`: a folder with all it holds (links inside are removed, never followed),
    or a file or a link itself (never what it points to). Missing is fine; other failures raise unless
    `ignore_errors`."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return

    def failed(
        _function: object, _path: object, error: tuple[type[BaseException], BaseException, object]
    ) -> None:
        # Gone meanwhile is removed; anything else is kept in place unless the caller can live with it.
        if not isinstance(error[1], FileNotFoundError) and not ignore_errors:
            raise error[1]

    if stat.S_ISDIR(info.st_mode):
        # rmtree walks by descriptors on Linux (shutil.rmtree.avoids_symlink_attacks): a link inside is
        # unlinked, never descended into, even one swapped in during the walk.
        shutil.rmtree(path, onerror=failed)
        return
    try:
        path.unlink()
    except FileNotFoundError:
        return
    except OSError:
        if not ignore_errors:
            raise


def read_regular(path: Path, limit: int) -> bytes | None:
    """The bytes of the regular file at `path` itself, or None when there is none to read there: missing, a
    link (never followed), a FIFO, socket or device (opened without blocking, never read), or over `limit`
    bytes. For a small file the job writes and root polls: whatever the job puts at the name, the read
    neither blocks nor grows past `limit`, nor reads what a link there points to."""
    try:
        with open_directory(path.parent) as fd:
            handle = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    except OSError:  # missing, a link (ELOOP), a socket (ENXIO): nothing to read, all alike
        return None
    try:
        info = os.fstat(handle)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            return None
        # The size may grow while it is read: one byte past `limit` is enough to refuse it.
        chunks: list[bytes] = []
        remaining = limit + 1
        while remaining > 0:
            chunk = os.read(handle, remaining)
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
    except OSError:
        return None
    finally:
        os.close(handle)
    data = b"".join(chunks)
    return data if len(data) <= limit else None


def regular_files(
    directory: Path, say: Callable[[str], None], *, skip: Callable[[str], bool] = lambda name: False
) -> Iterator[tuple[PurePosixPath, int]]:
    """Each regular file under `directory`, in name order, as (its path relative to `directory`, a read-only
    descriptor of it, closed once the next one is asked for); names `skip` says yes to are left out, folders
    too, with all they hold.

    The walk goes by descriptors, each name opened with O_NOFOLLOW|O_NONBLOCK relative to its folder's: a link
    (to a file or a folder, or swapped in during the walk) is never followed, nor a FIFO opened for reading
    blocked on; `say` gets one line naming each such name left out. `directory` itself being a link raises
    PlantedLinkError; missing, it holds nothing."""
    try:
        top = _open_folder(directory, str(directory))
    except FileNotFoundError:
        return
    try:
        yield from _regular_files(top, directory, PurePosixPath(), say, skip)
    finally:
        os.close(top)


def _regular_files(
    fd: int,
    directory: Path,
    relative: PurePosixPath,
    say: Callable[[str], None],
    skip: Callable[[str], bool],
) -> Iterator[tuple[PurePosixPath, int]]:
    for name in sorted(os.listdir(fd)):
        if skip(name):
            continue
        inner = relative / name
        try:
            handle = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        except FileNotFoundError:
            continue  # removed since the listing
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                target = _link_target(fd, name)
                say(f"{directory / inner}: a link (to {target}); not followed, left out")
                continue
            if exc.errno == errno.ENXIO:  # a socket: nothing to read
                say(f"{directory / inner}: not a regular file or folder; left out")
                continue
            raise
        try:
            mode = os.fstat(handle).st_mode
            if stat.S_ISDIR(mode):
                yield from _regular_files(handle, directory, inner, say, skip)
            elif stat.S_ISREG(mode):
                os.set_blocking(handle, True)
                yield inner, handle
            else:
                say(f"{directory / inner}: not a regular file or folder; left out")
        finally:
            os.close(handle)
