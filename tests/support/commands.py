"""`rankwatch` commands and benches run as a user runs them: as processes, in this process, or in a terminal."""

import contextlib
import gc
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.paths import ROOT


def rankwatch_cli(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the installed console script, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "rankwatch", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        timeout=300,
    )


def bench(script: str, *args: str) -> tuple[dict, str]:
    """Run bench/`script` as a user would; its last line's JSON object, and all it printed."""
    run = subprocess.run(
        [sys.executable, f"bench/{script}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stdout


def rankwatch_in_process(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The same command line run by `rankwatch`'s main in this process, its exit status, stdout and stderr
    as `rankwatch_cli` reports them: for commands that read or import a store, or answer a collector's
    API, or send a simulated run through an exporter object of their own, where a fresh interpreter proves
    nothing more and costs seconds of imports. Commands that start processes, serve, or instrument a job
    through the agent's process-wide session keep `rankwatch_cli`."""
    from rankwatch.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved, umask = dict(os.environ), os.umask(0o077)  # reading the umask sets it: it is set back below
    os.umask(umask)
    # What lives now is set aside from the collection below, which then goes over what the command made
    # alone: a full collection of a worker's heap (torch, pandas, Streamlit) took a tenth of a second.
    gc.freeze()
    os.environ.update(env or {})
    try:
        with contextlib.chdir(cwd or os.getcwd()), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(args))
                code = 0
            except SystemExit as e:  # as the interpreter ends on it: a message goes to stderr, status 1
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
                if not isinstance(e.code, int | None):
                    print(e.code, file=sys.stderr)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        os.umask(umask)  # a command that made its files owner-only (collector/private.py) did so for itself
        gc.collect()  # a store the command left open is closed, as its process's exit would close it
        gc.unfreeze()
    return subprocess.CompletedProcess(["rankwatch", *args], code, out.getvalue(), err.getvalue())


class Interactive:
    """A `rankwatch` command as a terminal runs it: in a process group of its own, with Ctrl-C working
    (a suite started in the background hands its children SIGINT ignored), its output read line by line."""

    def __init__(self, *args: str, env: dict | None = None):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rankwatch", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.lines: list[str] = []

    def read_until(self, text: str, timeout_s: float) -> str:
        """The output up to the line holding `text`."""
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            assert time.monotonic() < deadline, f"no {text!r} after {timeout_s:.0f} s:\n" + "".join(self.lines)
            line = self.process.stdout.readline()
            assert line, "it ended early:\n" + "".join(self.lines)
            self.lines.append(line)
        return "".join(self.lines)

    def stop(self, sig: signal.Signals) -> str:
        """The rest of the output, once the command has exited on `sig` (sent to it alone)."""
        self.process.send_signal(sig)
        try:
            return self.process.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running 60 s after {sig.name}:\n" + "".join(self.lines)) from None

    def left_running(self, timeout_s: float = 15) -> str:
        """The processes it started (collector, dashboard, torchrun, ranks) still running `timeout_s`
        after it exited, as `ps` lists them; "" when none."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                return ""
            time.sleep(0.5)
        return (
            subprocess.run(
                ["ps", "-o", "pid,args", "--no-headers", "-g", str(self.process.pid)], capture_output=True, text=True
            ).stdout
            or "(gone while listing)"
        )

    def kill(self) -> None:
        """Whatever is left of its process group, killed: a failed test leaves nothing behind."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
