"""NCPP evaluated with numpy: the collector's side of the model.

NCPP predicts a target as a prior's prediction (a baseline chosen on the training groups: the median
of the same configuration, the analytic model) times a correction that a group-attention network
predicts from the row's state: log(target / prior), scaled by a factor from 0 to 1 chosen on groups
held out in training (fit.py), so that at 0 the model is its prior.

The network: each feature becomes a token (a number scales its own learned vector; a category looks
up its own embedding). Each group's tokens, with a learned summary token, go through one pre-norm
attention block; the group's summary tokens then attend to each other in a second block, and their
mean is read out as the standardized correction. `fit.py` trains the same network in torch and saves
its weights under the names read here; tests hold the two forward passes equal.
"""

import json
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from collector.predict.analytic import Analytic
from collector.predict.groups import Encoded, Encoder
from collector.predict.priors import Median, Prior

BLOCK = ("ln1.w", "ln1.b", "wq", "wk", "wv", "wo", "ln2.w", "ln2.b", "w1", "b1", "w2", "b2")
MAX_MODEL_BYTES = 256 << 20  # a saved model's arrays, decompressed: its weights and header take a few MB
PRIORS: dict[str, type[Analytic] | type[Median]] = {Analytic.name: Analytic, Median.name: Median}  # by kind, saved
_ARRAY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * w + b


def _block(x: np.ndarray, p: dict[str, np.ndarray]) -> np.ndarray:
    """One pre-norm single-head attention block over tokens x (rows, tokens, width)."""
    h = _layer_norm(x, p["ln1.w"], p["ln1.b"])
    q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    x = x + (scores / scores.sum(-1, keepdims=True)) @ v @ p["wo"]
    h = _layer_norm(x, p["ln2.w"], p["ln2.b"])
    return x + np.maximum(h @ p["w1"] + p["b1"], 0.0) @ p["w2"] + p["b2"]


def token_groups(encoder: Encoder) -> list[np.ndarray]:
    """Per group, the indices of its tokens among all tokens (the numeric ones first, then categories)."""
    numeric, categorical = encoder.numeric, encoder.categorical
    return [
        np.array(
            [i for i, f in enumerate(numeric) if f.group == g]
            + [len(numeric) + i for i, f in enumerate(categorical) if f.group == g],
            dtype=np.int64,
        )
        for g in encoder.groups
    ]


def category_offsets(encoder: Encoder) -> np.ndarray:
    """Where each category's embeddings start in the one embedding table (code 0, unseen, included)."""
    sizes = [len(f.vocabulary) + 1 for f in encoder.categorical]
    return np.cumsum([0, *sizes[:-1]]).astype(np.int64)


@dataclass
class Network:
    """The group-attention network with its encoder, and the standardization of what it predicts."""

    encoder: Encoder
    weights: dict[str, np.ndarray]
    log_mean: float
    log_std: float

    def __post_init__(self) -> None:
        self._groups = token_groups(self.encoder)
        self._offsets = category_offsets(self.encoder)

    def forward(self, encoded: Encoded) -> np.ndarray:
        """The standardized output of each row."""
        w = self.weights
        n = encoded.numbers.shape[0]
        width = w["head.w"].shape[0]
        tokens = np.empty((n, encoded.numbers.shape[1] + encoded.codes.shape[1], width), dtype=np.float32)
        tokens[:, : encoded.numbers.shape[1]] = encoded.numbers[:, :, None] * w["num.scale"] + w["num.shift"]
        tokens[:, encoded.numbers.shape[1] :] = w["cat.table"][encoded.codes + self._offsets]
        summaries = []
        for g, index in enumerate(self._groups):
            p = {name: w[f"g{g}.{name}"] for name in BLOCK}
            x = np.concatenate([np.broadcast_to(w[f"g{g}.cls"], (n, 1, width)), tokens[:, index]], axis=1)
            summaries.append(_block(x, p)[:, 0])
        x = np.stack(summaries, axis=1) + w["x.group"]
        x = _block(x, {name: w[f"x.{name}"] for name in BLOCK}).mean(1)
        x = _layer_norm(x, w["head.ln.w"], w["head.ln.b"])
        return (x @ w["head.w"] + w["head.b"])[:, 0]

    def predict(self, table: pd.DataFrame) -> np.ndarray:
        """What the network was fitted to (a log), for each row of `table`."""
        return self.forward(self.encoder.encode(table)) * self.log_std + self.log_mean


@dataclass
class Model:
    """A fitted NCPP: its prior, and the network's correction to it scaled by `shrink` (none: 0)."""

    prior: Prior
    target: str  # what it predicts, in words ("score", "compute_s")
    correction: Network | None = None
    shrink: float = 0.0

    def predict(self, table: pd.DataFrame) -> np.ndarray:
        """The target for each row of `table`: the prior's prediction, corrected where the prior covers
        the row (its configuration was seen: the correction was learnt on such rows only)."""
        predicted = self.prior.predict(table)
        if self.correction is None or self.shrink == 0:
            return predicted
        log = np.where(self.prior.covers(table), self.shrink * self.correction.predict(table), 0.0)
        return predicted * np.exp(log)

    def save(self, path: Path, **meta: object) -> None:
        """One .npz: the network's weights, and the rest as JSON (with `meta`: how it was judged)."""
        network = self.correction
        header = {
            "target": self.target,
            "prior": {"kind": self.prior.name, **self.prior.to_json()},
            "shrink": self.shrink,
            "encoder": None if network is None else network.encoder.to_json(),
            "log_mean": None if network is None else network.log_mean,
            "log_std": None if network is None else network.log_std,
            **meta,
        }
        with open(path, "wb") as f:
            arrays: dict[str, Any] = {"__meta__": np.array(json.dumps(header)), **(network.weights if network else {})}
            np.savez_compressed(f, **arrays)

    @classmethod
    def load(cls, path: Path) -> tuple["Model", dict]:
        """The model saved at `path`, and the rest of what was saved with it; ValueError for a file that is
        not one, or whose arrays would take more than MAX_MODEL_BYTES."""
        try:
            _check_sizes(path)
            with np.load(path, allow_pickle=False) as data:
                header = json.loads(str(data["__meta__"]))
                weights = {k: data[k] for k in data.files if k != "__meta__"}
        except zipfile.BadZipFile as e:  # a damaged member too, found once read
            raise ValueError(f"not an .npz ({e})") from None
        except RecursionError:
            raise ValueError("its header nests deeper than JSON is read") from None
        try:
            return cls._from_header(header, weights), header
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"its header is not a saved model's ({type(e).__name__}: {e})") from None

    @classmethod
    def _from_header(cls, header: dict, weights: dict[str, np.ndarray]) -> "Model":
        """The model `header` describes, popping what it reads (the rest is the caller's). A file saved
        before priors were chosen has no shrink (its network's correction is whole) and an analytic
        prior without its kind."""
        saved = header.pop("prior")
        if saved is None:
            raise ValueError("a model without a prior, which this version no longer reads: fit it again")
        kind = saved.pop("kind", Analytic.name)
        if kind not in PRIORS:
            raise ValueError(f"its prior is of an unknown kind {kind!r}")
        prior = PRIORS[kind].from_json(saved)
        encoder, log_mean, log_std = header.pop("encoder"), header.pop("log_mean"), header.pop("log_std")
        network = None if encoder is None else Network(Encoder.from_json(encoder), weights, log_mean, log_std)
        return cls(prior, header.pop("target"), network, float(header.pop("shrink", 1.0)))


def _check_sizes(path: Path) -> None:
    """Refuse (ValueError; BadZipFile for no zip) a model file whose arrays would take more than
    MAX_MODEL_BYTES, before any is read. An .npz is a zip: its members declare their sizes, which
    zipfile reads no further than (a zip of 4 GiB of zeros takes 4 MB), and each member's .npy header
    declares a shape, which numpy allocates before reading the data: it must fit in its member. Only
    the compressions numpy writes are read, as deflate alone is inflated a bounded chunk at a time."""
    with zipfile.ZipFile(path) as archive:
        members = archive.infolist()
        if sum(m.file_size for m in members) > MAX_MODEL_BYTES:
            raise ValueError(f"its arrays take more than {MAX_MODEL_BYTES >> 20} MiB: not a saved model")
        for member in members:
            if member.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                raise ValueError(f"{member.filename} is compressed in a way numpy never writes")
            with archive.open(member) as f:
                read_header = _ARRAY_HEADERS.get(np.lib.format.read_magic(f))
                if read_header is None:
                    raise ValueError(f"{member.filename} is not an array of a format numpy writes")
                shape, _, dtype = read_header(f)
            if math.prod(shape) * dtype.itemsize > member.file_size:
                raise ValueError(f"{member.filename} declares an array larger than the file holds")
