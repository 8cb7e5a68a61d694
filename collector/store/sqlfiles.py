"""The files SQL may read, `sql-files://NAME` in a query: what is under `sql-files/` beside the store,
opened here and checked once open, never by a path DuckDB resolves and then opens again.

DuckDB checks a local path against `allowed_directories` and then opens it by name: a file swapped for a
link to `../token` between the two was read (6 of 2,000 queries), and a hard link to the token, or
`sql-files` itself a link to the store's directory, passed the check outright. So queries get no local
path at all (collector/store/readonly.py allows only this protocol), and DuckDB reads these files
through this fsspec filesystem: each is opened from a descriptor of `sql-files/` itself, one path part
at a time, none of them followed if it is a link (O_NOFOLLOW, and `sql-files` opened the same way),
and the opened file is then checked: a regular file with one link (a hard link to a secret has two),
or a directory to list. What DuckDB reads is the file that passed, whatever the name points to later.
"""

import os
import stat
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import fsspec

PROTOCOL = "sql-files"
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a pipe opens without a writer


class SqlFiles(fsspec.AbstractFileSystem):
    """`sql-files://NAME`: read-only, NAME a path under `root` without links, `.` or `..`."""

    protocol = PROTOCOL
    cachable = False  # one instance per root, never fsspec's shared one

    def __init__(self, root: Path, **kwargs: Any):
        super().__init__(**kwargs)
        self._root = root

    @classmethod
    def _strip_protocol(cls, path) -> str:
        return str(path).removeprefix(f"{PROTOCOL}://").strip("/")

    def _open(self, path, mode="rb", **kwargs):
        if mode != "rb":
            raise PermissionError(f"{PROTOCOL} are read only")
        return os.fdopen(self._opened(self._strip_protocol(path), directory=False), "rb")

    def info(self, path, **kwargs) -> dict:
        name = self._strip_protocol(path)
        try:
            fd = self._opened(name, directory=False)
        except IsADirectoryError:
            fd = self._opened(name, directory=True)
        except OSError as e:  # absent, a link, or refused: not there for SQL
            raise FileNotFoundError(f"{PROTOCOL}://{name}: {e.strerror or e}") from None
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        kind = "directory" if stat.S_ISDIR(st.st_mode) else "file"
        return {"name": name, "size": st.st_size, "type": kind, "mtime": st.st_mtime}

    def modified(self, path) -> datetime:
        """When the file last changed (read_text's and read_blob's `last_modified`)."""
        return datetime.fromtimestamp(self.info(path)["mtime"], UTC)

    def ls(self, path, detail=True, **kwargs) -> list:
        name = self._strip_protocol(path)
        fd = self._opened(name, directory=True)
        try:
            entries = sorted(os.listdir(fd))
        finally:
            os.close(fd)
        listed = []
        for entry in entries:
            try:
                listed.append(self.info(f"{name}/{entry}" if name else entry))
            except FileNotFoundError:  # a link, a hard link, a device: not listed
                continue
        return listed if detail else [e["name"] for e in listed]

    def glob(self, path, maxdepth=None, **kwargs):
        """The files a pattern matches, as DuckDB's own glob gives them: no directories."""
        found = super().glob(path, maxdepth=maxdepth, detail=True, **kwargs)
        return [name for name, entry in found.items() if entry["type"] == "file"]

    def _opened(self, name: str, directory: bool) -> int:
        """A descriptor of `name` under the root, opened part by part without following a link, and
        checked once open: a directory if `directory`, else a regular file with one link."""
        parts = [p for p in name.split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise PermissionError(f"{name}: . and .. are not allowed")
        fd = os.open(self._root, _DIRECTORY_FLAGS)
        try:
            for i, part in enumerate(parts):
                inner = i < len(parts) - 1 or directory
                opened = os.open(part, _DIRECTORY_FLAGS if inner else _FILE_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = opened
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode) and not directory:
                raise IsADirectoryError(name)
            if not stat.S_ISDIR(st.st_mode) and not (stat.S_ISREG(st.st_mode) and st.st_nlink == 1):
                raise PermissionError(f"{name}: not a file of its own (a hard link, a device or a pipe)")
        except BaseException:
            os.close(fd)
            raise
        return fd
