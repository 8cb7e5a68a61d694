"""Starting rankwatch's processes: the reference trainer under torchrun, an unmodified job with the agent
in it (`rankwatch run`), and waiting for a collector."""

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote, urlsplit

import rankwatch.agent.autostart as autostart_package
from rankwatch.agent import auto, config, paths
from rankwatch.agent.apiclient import ApiClient, ApiError
from rankwatch.agent.config import INGEST, NODE_ENV, TOKEN_ENV, TOKEN_FILE_ENV, UNDELIVERED_ENV

# `train` and `simulate`: the job ran, but telemetry of it never reached the collector (1 is a failed job, 2 bad input)
TELEMETRY_LOST = 3
DASHBOARD_CHECK_S = 1.0  # how long a job's start waits to learn whether a dashboard listens


def train_command(
    nproc: int,
    steps: int,
    faults: Sequence[str],
    model: str = "tiny",
    max_restarts: int = 0,
    trainer_args: Sequence[str] = (),
) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "-m",
        "trainer.train",
        "--steps",
        str(steps),
        "--model",
        model,
        *trainer_args,
    ]
    for spec in faults:
        command += ["--inject", spec]
    return command


def train(
    nproc: int,
    steps: int,
    run_id: str | None = None,
    faults: Sequence[str] = (),
    collector: str | None = None,
    model: str = "tiny",
    token: str | None = None,
    max_restarts: int = 0,
    trainer_args: Sequence[str] = (),
    store: Path | None = None,
    device: str = "auto",
) -> int:
    """Run the trainer to the end; returns torchrun's exit status, or TELEMETRY_LOST when it was 0 but
    a rank's telemetry never reached the collector (each rank notes what its exporter dropped in the
    UNDELIVERED_ENV directory). After a failure torchrun starts the job again, up to `max_restarts`
    times, and the trainer resumes from its last checkpoint. Interrupted, it stops the job before it
    returns. `store`: the store the job's checkpoints are kept beside (`runs/RUN/checkpoints`; default:
    $RANKWATCH_DB's, else ./rankwatch-data's). `device`: auto, cpu or cuda (trainer/device.py;
    DeviceError for cuda without a GPU per rank, before anything starts). Each rank checks its token
    at init (agent.config.TokenRefused); `rankwatch train` checks it before calling this."""
    import torch

    from trainer.device import choose

    device, notice = choose(device, nproc, torch.cuda.device_count())
    if notice:
        print(f"rankwatch: {notice}", file=sys.stderr, flush=True)
    run_id, collector, token = (
        run_id or time.strftime("run-%Y%m%d-%H%M%S"),
        config.collector_urls(collector),
        config.token(token),
    )
    store = (store or paths.store_path()).resolve()  # the ranks' working directory must not matter
    announce("train", run_id, collector, store)
    print(f"rankwatch train: checkpoints in {paths.checkpoint_dir(store, run_id)}", flush=True)
    env = {
        "RANKWATCH_RUN_ID": run_id,
        "RANKWATCH_COLLECTOR": collector,
        "OMP_NUM_THREADS": "1",
        # a fresh store for each attempt: in the rendezvous' shared one, a restarted rank may read the
        # address its peer had before the restart and fail to connect (pytorch/pytorch#135712)
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        paths.DB_ENV: str(store),
    }
    command = train_command(nproc, steps, list(faults), model, max_restarts, ["--device", device, *trainer_args])
    return _job("train", command, env, run_id, collector, token)


def run(
    command: Sequence[str],
    run_id: str | None = None,
    collector: str | None = None,
    token: str | None = None,
    store: Path | None = None,
):
    """Run an unmodified job's command (`torchrun ... train.py`, `python train.py`) with the agent in
    every Python process it starts (rankwatch/agent/auto.py, through the sitecustomize of rankwatch/agent/autostart/ on
    its PYTHONPATH); returns its exit status, or TELEMETRY_LOST as `train`. FileNotFoundError where
    the command is not found. `store`: the collector's, beside which its dashboard's address is noted
    (default: $RANKWATCH_DB's, else ./rankwatch-data's)."""
    run_id, collector, token = (
        run_id or time.strftime("run-%Y%m%d-%H%M%S"),
        config.collector_urls(collector),
        config.token(token),
    )
    announce("run", run_id, collector, (store or paths.store_path()).resolve())
    autostart = str(Path(autostart_package.__file__).parent)
    env = {
        "RANKWATCH_RUN_ID": run_id,
        "RANKWATCH_COLLECTOR": collector,
        auto.ENV: "1",
        "PYTHONPATH": os.pathsep.join(p for p in (autostart, os.environ.get("PYTHONPATH")) if p),
    }
    return _job("run", list(command), env, run_id, collector, token)


def _job(program: str, command: list[str], env: dict, run_id: str, collector: str, token: str | None) -> int:
    """Run a job's command to its end with `env` added (and the job's token, `job_token`), beside the node's
    sidecar (`rankwatch node`, which exports what the job's ranks hand it), stopping it if interrupted; its
    exit status, or TELEMETRY_LOST where it was 0 but a rank's telemetry never reached the collector (the
    sidecar, and each rank that exported its own, note what they dropped in the UNDELIVERED_ENV directory)."""
    env = {k: v for k, v in {**os.environ, **env}.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}
    env.update(config.flight_recorder(env))  # the ring a rank's answer to a stacks request reads
    private = Path(tempfile.mkdtemp(prefix="rankwatch-job-"))  # mode 0700: the job's token, its notes of loss
    try:
        undelivered = private / "undelivered"
        undelivered.mkdir()
        env[UNDELIVERED_ENV] = str(undelivered)
        if token:
            env[TOKEN_FILE_ENV] = str(job_token(token, private / "token"))
        with sidecar(private / "node.sock", collector, env) as node:
            if node:
                env[NODE_ENV] = node
            with subprocess.Popen(command, env=env) as job:
                try:
                    status = job.wait()
                except BaseException:  # interrupted: torchrun stops its workers on SIGTERM (SIGKILL would orphan them)
                    job.terminate()
                    job.wait()
                    raise
        notes = [json.loads(f.read_text()) for f in undelivered.iterdir()]  # one per rank process that lost any
    finally:
        shutil.rmtree(private, ignore_errors=True)
    if notes:
        totals = {key: sum(note.get(key, 0) for note in notes) for key in ("rank_steps", "spans", "records", "samples")}
        report_loss(program, run_id, collector, **totals)
        return status or TELEMETRY_LOST
    return status


@contextmanager
def sidecar(path: Path, collector: str, env: dict, start_s: float = 60.0):
    """The node's sidecar listening at `path` for the job's ranks while the block runs (its socket path,
    or None where it did not start: the ranks then export their own, as with $RANKWATCH_NODE=""), then
    stopped: it delivers what waits before it exits."""
    if env.get(NODE_ENV) == "":
        yield None
        return
    node = subprocess.Popen(
        [sys.executable, "-m", "rankwatch", "node", "--socket", str(path), "--collector", collector],
        env={k: v for k, v in env.items() if k != NODE_ENV},
    )
    try:
        give_up = time.monotonic() + start_s
        while not path.exists() and node.poll() is None and time.monotonic() < give_up:
            time.sleep(0.05)
        if not path.exists():
            print("rankwatch: the node sidecar did not start: each rank exports its own telemetry", file=sys.stderr)
        yield str(path) if path.exists() else None
    finally:
        node.terminate()
        try:
            node.wait(timeout=120)
        except subprocess.TimeoutExpired:
            node.kill()
            node.wait()


def job_token(token: str, path: Path) -> Path:
    """`path`, written owner-only with the token a job's processes get: an ingest token, made from the
    collector's (a scoped token given is passed on as it is). Whatever code the job runs can then send
    telemetry and take its commands, but neither post commands nor query; and no token is in the job's
    environment, which every process it starts inherits and which logs and crash reports copy."""
    scoped = token if config.token_scope(token) else config.scoped_token(token, INGEST)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(scoped + "\n")
    return path


def report_loss(program: str, run_id: str, collector: str, rank_steps: int, spans: int, records: int, samples: int):
    """Say on stderr what of a run never reached its collector: rank-steps first, what the store lacks."""
    print(
        f"rankwatch {program}: error: run {run_id}: {rank_steps} rank-steps ({spans} spans), {records} log records "
        f"and {samples} device samples never reached {collector}",
        file=sys.stderr,
        flush=True,
    )


def announce(program: str, run_id: str, collector: str, store: Path) -> None:
    """Say, before a job starts, which run it is, where its telemetry goes and where to watch it: at the
    dashboard last started on `store` (or its collector) while it serves, else how to start one."""
    dashboard = serving_dashboard(store)
    if dashboard is not None:
        watch = f"watch it at {dashboard}/?run={quote(run_id)} (rankwatch dashboard)"
    else:
        given = "" if store.resolve() == paths.store_path().resolve() else f" --db {shlex.quote(str(store))}"
        watch = f"to watch it, start a dashboard: rankwatch dashboard --collector {collector.split(',')[0]}{given}"
    print(f"rankwatch {program}: run {run_id}, telemetry to {collector}; {watch}", flush=True)


def serving_dashboard(store: Path) -> str | None:
    """The address of the dashboard last started on `store` (or its collector), noted beside it, while something
    listens there; None where none was started or it has stopped (the note outlives it)."""
    try:
        address = (store.parent / paths.DASHBOARD_FILE).read_text().strip()
    except OSError:
        return None
    return address if listening(address) else None


def listening(url: str) -> bool:
    """Whether something accepts connections at `url`'s host and port."""
    try:
        address = urlsplit(url)
        with socket.create_connection((address.hostname, address.port), timeout=DASHBOARD_CHECK_S):
            return True
    except (OSError, ValueError, TypeError):  # nothing listening, or not an address with a port
        return False


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Block until the collector answers /healthz (or fail if it died)."""
    deadline, api = time.monotonic() + timeout_s, ApiClient(url, None, timeout_s=1)
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"collector exited with status {process.returncode}")
        try:
            api.get("/healthz")
            return
        except ApiError:  # not listening yet, or 503 while its store opens
            pass
        time.sleep(0.2)
    raise RuntimeError(f"collector not healthy at {url} after {timeout_s:.0f}s")
