"""Owner-only files: the store, its WAL, the token and everything else the collector writes hold every
rank's telemetry or the key to it, so no other local user may read them (files 0600, directories 0700).

A umask set before anything is created covers the collector's own files, DuckDB's (the store, its WAL
and spill files) and those of the processes it starts. A data directory that already exists is not
the collector's to change (it may be a home directory): when other users can enter it, the files the
collector keeps there are tightened instead, and it says so once.
"""

import os
import stat
import sys
from pathlib import Path

from rankwatch.agent.paths import SQL_FILES_DIR, TOKEN_FILE

OWNER_ONLY = 0o077  # the umask: no bit for group or others


def restrict(store: Path) -> None:
    """Make what the collector of `store` creates from now on owner-only, its data directory (0700)
    included, and tighten what an earlier collector left there with wider modes."""
    os.umask(OWNER_ONLY)
    data_dir = store.parent
    if not data_dir.exists():
        data_dir.mkdir(mode=0o700, parents=True)
        return
    if stat.S_IMODE(data_dir.stat().st_mode) & OWNER_ONLY:
        print(
            f"rankwatch: {data_dir} is open to other users (mode {stat.S_IMODE(data_dir.stat().st_mode):o}); "
            "the files rankwatch keeps in it are made owner-only",
            file=sys.stderr,
        )
    for path in (store, Path(f"{store}.wal"), data_dir / TOKEN_FILE, data_dir / SQL_FILES_DIR):
        if path.exists() and not path.is_symlink() and stat.S_IMODE(path.stat().st_mode) & OWNER_ONLY:
            path.chmod(0o700 if path.is_dir() else 0o600)
