"""The project's first-use cache: one root folder, an inter-process lock per entry, atomic installs.

The atomic install (build in a temporary sibling, then one ``rename``) is also how the trainer commits a checkpoint
(``hf_bdlm/checkpoints/atomic.py``): :func:`temporary_sibling`, :func:`leftovers`, :func:`sync_tree` and
:func:`replace_dir` are shared.

Everything hf_bdlm writes once and reuses (the exported embedded model, the planner's CPU rates) lives under
``$HF_BDLM_HOME`` (default ``~/.cache/hf_bdlm``). Several processes may meet an empty cache at once (the ranks of
a launch, parallel test workers, two runs started together), so every entry is created under a file lock
(``filelock``: an OS lock, released by the kernel when its holder dies) and becomes visible in one ``rename``:
a reader sees a complete entry or none, and an entry whose writer was killed half way is rebuilt by the next
process that takes the lock.

    from hf_bdlm.cache import cache_home, install_dir
    path = install_dir(cache_home() / "my-entry", build=lambda tmp: (tmp / "data.txt").write_text("x"),
                       is_complete=lambda p: (p / "data.txt").is_file())
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Iterator

from filelock import FileLock

HOME_ENV = "HF_BDLM_HOME"
_TMP_MARK = ".tmp-"


def cache_home() -> pathlib.Path:
    """``$HF_BDLM_HOME`` if set (and not empty), else ``~/.cache/hf_bdlm``; read at each call, never created here."""
    return pathlib.Path(os.environ.get(HOME_ENV) or os.path.join("~", ".cache", "hf_bdlm")).expanduser()


@contextlib.contextmanager
def entry_lock(path: str | os.PathLike) -> Iterator[None]:
    """Hold the inter-process lock of the cache entry ``path`` (the file ``.<name>.lock`` beside it)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path.parent / f".{path.name}.lock")):
        yield


def temporary_sibling(path: str | os.PathLike, tag: str) -> pathlib.Path:
    """The temporary sibling ``.<name>.tmp-<tag>`` of ``path``: where a writer builds ``path`` before renaming it into
    place. Hidden (a leading dot) and never matching ``path``'s own name, so no reader takes it for the entry."""
    path = pathlib.Path(path)
    return path.parent / f".{path.name}{_TMP_MARK}{tag}"


def leftovers(path: str | os.PathLike) -> list[pathlib.Path]:
    """Temporary folders and files of ``path`` that an interrupted writer left behind."""
    path = pathlib.Path(path)
    if not path.parent.is_dir():
        return []
    return sorted(path.parent.glob(f".{path.name}{_TMP_MARK}*"))


def sync_tree(path: str | os.PathLike) -> None:
    """``fsync`` every file under ``path`` and every folder (their entries), so that a rename that follows publishes
    data that is on disk: a lost node or a power cut cannot leave a renamed entry with missing bytes."""
    path = pathlib.Path(path)
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace_dir(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Rename the finished folder ``tmp`` to ``path``. An existing ``path`` is first moved aside (to a temporary
    sibling, removed afterwards), so that at every moment ``path`` is either the old entry, absent, or the new one."""
    tmp, path = pathlib.Path(tmp), pathlib.Path(path)
    old = None
    if path.exists() or path.is_symlink():
        old = temporary_sibling(path, "replaced")
        _remove(old)
        os.rename(path, old)
    os.rename(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself
    finally:
        os.close(fd)
    if old is not None:
        _remove(old)


def _remove(path: pathlib.Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def install_dir(path: str | os.PathLike, build: Callable[[pathlib.Path], None],
                is_complete: Callable[[pathlib.Path], bool]) -> tuple[pathlib.Path, bool]:
    """Make sure the folder ``path`` holds a complete entry, building it at most once across processes.

    Under the entry's lock: if ``is_complete(path)`` (another process finished while this one waited), nothing is
    done. Otherwise the leftovers of interrupted writers and an incomplete ``path`` are removed, ``build(tmp)`` fills
    a fresh temporary sibling folder, and the folder is renamed to ``path`` in one step.

    Returns:
        ``(path, built)``: ``built`` is True in the one process that built the entry.
    """
    path = pathlib.Path(path)
    if is_complete(path):
        return path, False
    with entry_lock(path):
        if is_complete(path):
            return path, False
        for stale in leftovers(path):
            _remove(stale)
        tmp = pathlib.Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}{_TMP_MARK}"))
        try:
            os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's folder is private (0700); the entry is an ordinary folder
            build(tmp)
            if not is_complete(tmp):
                raise RuntimeError(
                    f"building the cache entry {path} left an incomplete folder: {sorted(os.listdir(tmp))}")
            replace_dir(tmp, path)  # over an incomplete entry (written by an older version, or by hand)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return path, True


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def update_json(path: str | os.PathLike, update: Callable[[dict], dict | None]) -> dict:
    """Read-modify-write the JSON file ``path`` under its lock; the new content replaces the old in one rename.

    ``update`` receives the current content (``{}`` when absent) and returns the new one, or None to leave the file
    as it is. Returns the content after the call.
    """
    path = pathlib.Path(path)
    with entry_lock(path):
        current = json.loads(path.read_text()) if path.is_file() else {}
        new = update(current)
        if new is None:
            return current
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}{_TMP_MARK}")
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(new, handle, indent=1)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return new
