"""PyTorch NCCL Flight Recorder dumps as PyTorch writes them, for the tests that import them: a 4-rank
job's per-rank dumps (a pickle of plain data per rank, named <prefix><rank>; or JSON)."""

import json
import pickle

T0 = 1_724_779_239_000_000_000
MB4 = [[1024, 1024]]  # 4 MiB of Float
WORLD = {"0": ("default_pg", [0, 1, 2, 3])}
TP = {0: {"1": ("tp", [0, 1])}, 1: {"1": ("tp", [0, 1])}, 2: {"2": ("tp", [2, 3])}, 3: {"2": ("tp", [2, 3])}}


def entry(
    record_id: int,
    seq: int,
    op: str = "all_reduce",
    state: str = "completed",
    pg: tuple = ("0", "default_pg"),
    input_sizes: list = MB4,
    output_sizes: list | None = None,
    dtype: str = "Float",
    p2p_seq: int = 0,
) -> dict:
    """One Flight Recorder entry, with the keys (and None for times not seen) of a PyTorch 2.5 pickle."""
    created = T0 + record_id * 10_000_000
    p2p = op.startswith(("send", "recv"))
    output_sizes = input_sizes if output_sizes is None else output_sizes
    return {
        "frames": [{"name": "train_step", "filename": "train.py", "line": 42}],
        "record_id": record_id,
        "pg_id": int(pg[0]),
        "process_group": pg,
        "collective_seq_id": seq,
        "p2p_seq_id": p2p_seq,
        "op_id": record_id + 1,
        "profiling_name": f"nccl:{op}",
        "time_created_ns": created,
        "input_sizes": input_sizes,
        "input_dtypes": [dtype] * len(input_sizes),
        "output_sizes": output_sizes,
        "output_dtypes": [dtype] * len(output_sizes),
        "state": state,
        "time_discovered_started_ns": None if state == "scheduled" else created + 1_000_000,
        "time_discovered_completed_ns": created + 4_000_000 if state == "completed" else None,
        "retired": state == "completed",
        "timeout_ms": 600_000,
        "is_p2p": p2p,
    }


def job(last: dict[int, dict | None]) -> dict[int, dict]:
    """Each rank's dump: an all_gather in its tp group, all_reduce #1-6 of the world completed, a send
    from rank 0 to rank 1 in their tp group, then `last[rank]` (an entry's keyword arguments) as #7."""
    dumps = {}
    for rank in range(4):
        tp_group, (tp_desc, _) = next(iter(TP[rank].items()))
        entries = [
            entry(
                0, 1, "all_gather", pg=(tp_group, tp_desc), input_sizes=[[256]], output_sizes=[[512]], dtype="BFloat16"
            )
        ]
        entries += [entry(i, i, pg=("0", "default_pg")) for i in range(1, 7)]
        if rank in (0, 1):
            # PyTorch leaves the group's last collective number on a point-to-point entry
            entries.append(
                entry(
                    7,
                    6,
                    "send 0->1" if rank == 0 else "recv 1<-0",
                    pg=(tp_group, tp_desc),
                    input_sizes=[[128]],
                    p2p_seq=1,
                )
            )
        if last[rank] is not None:
            entries.append(entry(8, 7, **last[rank]))
        config = {
            name: {"name": name, "desc": desc, "ranks": json.dumps(ranks)}
            for name, (desc, ranks) in (WORLD | TP[rank]).items()
        }
        dumps[rank] = {
            "version": "2.5",
            "pg_config": config,
            "entries": entries,
            "pg_status": {
                "0": {
                    "last_enqueued_collective": 7 if last[rank] else 6,
                    "last_started_collective": -1,
                    "last_completed_collective": 6,
                }
            },
        }
    return dumps


HUNG = {0: {"state": "started"}, 1: {"state": "started"}, 2: None, 3: {"state": "started"}}


def write(directory, dumps: dict[int, dict], as_json: bool = False):
    """The dumps as PyTorch writes them: /…/nccl_trace_rank_<rank>, a pickle (or dump_json's JSON)."""
    directory.mkdir()
    for rank, dump in dumps.items():
        path = directory / f"nccl_trace_rank_{rank}"
        if as_json:
            path.write_text(json.dumps(json_dump(dump)))
        else:
            path.write_bytes(pickle.dumps(dump, protocol=2))
    return directory


def json_dump(dump: dict) -> dict:
    """What TORCH_FR_DUMP_JSON writes instead: no frames, 0 for a time not seen, pg_status as strings."""
    return {
        **dump,
        "pg_status": {pg: {k: str(v) for k, v in s.items()} for pg, s in dump["pg_status"].items()},
        "entries": [
            {
                **{k: v for k, v in e.items() if k != "frames"},
                "time_discovered_started_ns": e["time_discovered_started_ns"] or 0,
                "time_discovered_completed_ns": e["time_discovered_completed_ns"] or 0,
            }
            for e in dump["entries"]
        ],
    }
