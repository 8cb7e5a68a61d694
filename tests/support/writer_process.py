"""The collector's writer process, found and waited for from outside."""

import os


def writer_pid(collector) -> int | None:
    """The process that holds the collector's store file open: its writer (the path is the test's own).
    Every process is looked at: /proc's list of a thread's children may miss a child its thread
    started just then, and the collector starts a writer again from a thread."""
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == str(collector.db):
                    return pid
            except OSError:
                continue
    return None


def dead(pid: int) -> bool:
    """Whether the process has exited: gone, or a zombie with no thread left. A killed process's main thread is
    a zombie while its other threads still exit, for some milliseconds, and until they have its parent can
    neither reap it nor tell it from a live one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z" and os.listdir(f"/proc/{pid}/task") == [str(pid)]
    except (FileNotFoundError, ProcessLookupError):  # reaped before, or while, it was read
        return True
