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
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True
