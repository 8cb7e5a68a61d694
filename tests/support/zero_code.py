"""`rankwatch run -- torchrun` of an unmodified script, as the zero-code tests run it."""

import subprocess
import sys
from pathlib import Path

from tests.support.commands import rankwatch_cli
from tests.support.paths import JOBS

SCRIPT = JOBS / "plain_ddp.py"

TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def rankwatch_run(collector, run_id: str, *command: str) -> subprocess.CompletedProcess:
    """`rankwatch run -- COMMAND` to its end, sending to `collector`, which goes on running (the jobs of a
    module can share one, stopped once they have all run)."""
    return rankwatch_cli(
        *("run", "--collector", collector.url, "--run", run_id, "--", *command),
        env={"RANKWATCH_TOKEN": collector.token},
    )


def torchrun(script: Path, *args: str, nproc: int = 2) -> tuple[str, ...]:
    """The command line of `script` under torchrun on two ranks (or `nproc`) of this machine."""
    return (TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), str(script), *args)


def two_ranks(collector, run_id: str, script: Path, *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """`rankwatch run -- torchrun` of `script` on two ranks (or `nproc`), sending to `collector`; the
    collector stopped after it, so that its store can be read."""
    job = rankwatch_run(collector, run_id, *torchrun(script, *args, nproc=nproc))
    collector.stop()
    return job
