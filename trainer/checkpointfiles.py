"""A checkpoint's files on disk: durable writes, manifests, verified reads, and each replica's share.

A checkpoint is a directory per step: each file is written under a temporary name, fsync'd and
renamed, then a manifest with the files' blake2b checksums and the state's layout is written and
renamed last, so a directory without one is partial. Data-parallel replicas hold the same tensors,
so each writes only its share of them. Listing checkpoints reads manifests only; the one about to be
loaded is read in full and checked: a checkpoint whose manifest is missing or does not match its
files, or whose layout is not the live state's or its replicas', is partial, damaged or another's,
and is never loaded (`Corrupt` says why).
"""

import ctypes
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from trainer.snapshotformat import ALIGN, _Ref, fingerprint, read_state_file, state_file

MANIFEST, TENSORS, META = "manifest.json", "tensors.bin", "state.pkl"
_CHUNK = 64 << 20  # bytes per write, read and hash call


class Corrupt(Exception):
    """A checkpoint on disk that must not be loaded; the message says why."""


def step_directory(directory: Path, step: int) -> Path:
    """Where the checkpoint of `step` lies in a replica's `directory`."""
    return directory / f"step-{step:08d}"


def checkpoints_in(directory: Path) -> dict[int, Path]:
    """step -> directory of every checkpoint in a replica's `directory`, complete or not."""
    if not directory.is_dir():
        return {}
    return {int(p.name[5:]): p for p in directory.glob("step-*") if p.name[5:].isdigit()}


def _memory(buffer: torch.Tensor) -> memoryview:
    """The bytes of a CPU uint8 tensor, not copied: files are written, hashed and read in place."""
    return memoryview((ctypes.c_ubyte * buffer.numel()).from_address(buffer.data_ptr())).cast("B")


def _share(nbytes: int, index: int, count: int) -> tuple[int, int]:
    """The bytes [lo, hi) of a flat buffer of `nbytes` that replica `index` of `count` writes."""
    per = -(-nbytes // (count * ALIGN)) * ALIGN
    return min(index * per, nbytes), min((index + 1) * per, nbytes)


def _fsync_dir(path: Path) -> None:
    """Make the names created or renamed in a directory durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: memoryview) -> dict:
    """Write under a temporary name, fsync, rename: `path` is absent or complete. Returns its manifest entry."""
    digest, tmp = hashlib.blake2b(), path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for i in range(0, len(data), _CHUNK):
            digest.update(data[i : i + _CHUNK])
            f.write(data[i : i + _CHUNK])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"bytes": len(data), "blake2b": digest.hexdigest()}


def write_checkpoint(
    path: Path, step: int, meta: bytes, refs: list[_Ref], buffer: torch.Tensor, nbytes: int, own: int, replicas: int
) -> int:
    """Files first, each complete under its name, then the manifest that vouches for them; the bytes of
    its files. The tensors file holds replica `own`'s share (of `replicas`) of the `nbytes` of `buffer`."""
    path.mkdir(parents=True, exist_ok=True)
    _fsync_dir(path.parent)
    (path / MANIFEST).unlink(missing_ok=True)  # a rewrite: the old manifest must not vouch for new files
    lo, hi = _share(nbytes, own, replicas)
    files = {
        META: _write_durably(path / META, memoryview(state_file(meta, refs))),
        TENSORS: _write_durably(path / TENSORS, _memory(buffer)[lo:hi]),
    }
    _fsync_dir(path)
    _write_durably(
        path / MANIFEST,
        memoryview(
            json.dumps(
                {
                    "step": step,
                    "files": files,
                    "share": [lo, hi],
                    "tensor_bytes": nbytes,
                    "layout": fingerprint(meta, refs, replicas),
                }
            ).encode()
        ),
    )
    _fsync_dir(path)
    return hi - lo + files[META]["bytes"]


def _manifest(path: Path, step: int) -> dict:
    """A checkpoint directory's manifest, checked against the sizes of its files: metadata only, no data read."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = {
            name: (int(manifest["files"][name]["bytes"]), str(manifest["files"][name]["blake2b"]))
            for name in (META, TENSORS)
        }
        share, nbytes = (int(manifest["share"][0]), int(manifest["share"][1])), int(manifest["tensor_bytes"])
        layout = manifest["layout"]
        layout = {
            "replicas": int(layout["replicas"]),
            "tensors": str(layout["tensors"]),
            "objects": dict(layout["objects"]),
        }
        if manifest["step"] != step:
            raise Corrupt(f"the manifest is of step {manifest['step']}")
    except FileNotFoundError:
        raise Corrupt("no manifest (a partial checkpoint)") from None
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise Corrupt(f"unreadable manifest ({e!r})") from None
    for name, (size, _) in files.items():
        if not (path / name).is_file():
            raise Corrupt(f"{name} is missing")
        if (path / name).stat().st_size != size:
            raise Corrupt(f"{name} has {(path / name).stat().st_size} bytes, the manifest says {size}")
    return {"files": files, "share": share, "tensor_bytes": nbytes, "layout": layout}


def manifests(paths: list[Path], own: int, step: int) -> list[dict]:
    """The manifests of `step` of every replica (its checkpoint directory in `paths`, this one's `paths[own]`),
    each checked against its files' sizes: metadata only. Corrupt names the replica, unless it is this one."""
    found = []
    for i, path in enumerate(paths):
        try:
            found.append(_manifest(path, step))
        except Corrupt as e:
            raise Corrupt(str(e) if i == own else f"replica {path.parent.name}: {e}") from None
    return found


def _read_verified(path: Path, into: memoryview, expected_digest: str) -> None:
    """Read a file whose size its manifest vouched for into `into`, checked against its checksum."""
    digest = hashlib.blake2b()
    with open(path, "rb") as f:
        for i in range(0, len(into), _CHUNK):
            chunk = into[i : i + _CHUNK]
            if f.readinto(chunk) != len(chunk):
                raise Corrupt(f"{path.name} ended early")
            digest.update(chunk)
    if digest.hexdigest() != expected_digest:
        raise Corrupt(f"{path.name} does not match its checksum")


def read_checkpoint(
    paths: list[Path], own: int, step: int, live: dict[str, str | None]
) -> tuple[bytes, list[_Ref], torch.Tensor]:
    """(pickled state, layout, tensor buffer) of a checkpoint: this replica's state from `paths[own]`,
    the tensors from the shares of every replica's directory, each verified against its manifest.
    Before any data is read, its layout must be that of the live state (`live`, its `objects`) and
    of every replica: a shard of other tensors (FSDP, TP, ZeRO) passes its checksums, and must not be
    spliced in."""
    found = manifests(paths, own, step)
    layout = found[own]["layout"]
    if layout["replicas"] != len(paths):
        raise Corrupt(f"written by a group of {layout['replicas']} replicas, loaded by one of {len(paths)}")
    for name, digest in live.items():
        if digest is not None and layout["objects"].get(name) != digest:
            raise Corrupt(f"its {name} is not the live one's layout (other tensor names, dtypes or shapes)")
    for path, manifest in zip(paths, found, strict=True):
        if manifest["layout"] != layout:
            raise Corrupt(f"replica {path.parent.name}: its layout is not this replica's (a shard of other tensors?)")
    size, digest = found[own]["files"][META]
    state = torch.empty(max(size, 1), dtype=torch.uint8)  # held while its memory is read
    _read_verified(paths[own] / META, _memory(state)[:size], digest)
    try:
        meta, refs = read_state_file(_memory(state)[:size])
        written = fingerprint(meta, refs, len(paths))
    except Exception as e:  # bytes that match their checksum yet are no checkpoint's state: any of a dozen types
        raise Corrupt(f"{META} is not a checkpoint's state ({e})") from None
    if written != layout:
        raise Corrupt(f"{META} is not the state its manifest describes")
    nbytes = found[own]["tensor_bytes"]
    buffer = torch.empty(max(nbytes, ALIGN), dtype=torch.uint8)
    for i, (path, manifest) in enumerate(zip(paths, found, strict=True)):
        where = "" if i == own else f"replica {path.parent.name}: "
        lo, hi = _share(nbytes, i, len(paths))
        if manifest["tensor_bytes"] != nbytes or manifest["share"] != (lo, hi):
            raise Corrupt(f"{where}its share is not bytes {lo} to {hi} of {nbytes}")
        try:
            _read_verified(path / TENSORS, _memory(buffer)[lo:hi], manifest["files"][TENSORS][1])
        except Corrupt as e:
            raise Corrupt(f"{where}{e}") from None
    return meta, refs, buffer


def remove(path: Path) -> None:
    """Remove a checkpoint directory, its manifest first: no longer a checkpoint even if this stops half-way."""
    (path / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(path)
