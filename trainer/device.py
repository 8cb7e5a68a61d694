"""Which device a job's ranks train on: a GPU each where the machine has one for every rank it runs,
else the CPU. Several NCCL ranks on one GPU fail (or hang) inside NCCL, far from the cause, so a job
that asks for CUDA without a GPU per rank is refused before it starts."""

DEVICES = ("auto", "cpu", "cuda")


class DeviceError(ValueError):
    """CUDA asked for where there is not a GPU for every rank; the message says so in one line."""


def choose(requested: str, ranks: int, gpus: int) -> tuple[str, str | None]:
    """("cuda" or "cpu", a one-line notice or None) for `ranks` ranks on a machine with `gpus` GPUs.
    `auto` takes the GPUs when there are enough, else the CPU with a notice where GPUs are left unused."""
    if requested == "cpu":
        return "cpu", None
    if gpus >= ranks:
        return "cuda", None
    if requested == "cuda":
        raise DeviceError(
            f"--device cuda needs a GPU for every rank: {ranks} ranks on this machine, "
            f"{gpus} GPU{'s' if gpus != 1 else ''}"
        )
    if gpus:
        return "cpu", (
            f"{ranks} ranks on {gpus} GPU{'s' if gpus != 1 else ''}: training on the CPU (gloo); "
            f"--nproc {gpus} trains on the GPUs"
        )
    return "cpu", None
