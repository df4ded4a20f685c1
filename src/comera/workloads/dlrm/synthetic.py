"""A seeded synthetic click log with Criteo's schema (power-law ids) and a planted low-rank logistic click
model, row ``i`` the same whatever the number of rows, optionally cached as memmaps. Details:
docs/recipes.md, 'Workload data'.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from comera.data.cache import building_folder, read_entry
from comera.workloads.dlrm.clicks import ClickData
from comera.workloads.dlrm.criteo import (
    KAGGLE_CARDINALITIES,
    NUM_CATEGORICAL,
    NUM_INTEGER,
    split_by_line_order,
)

__all__ = ["SyntheticCriteo", "synthetic_criteo"]

_BLOCK = 1 << 13
_PILOT_ROWS = 1 << 14
_TABLE_LIMIT = 1 << 20  # tables up to this size get their per-id values precomputed
_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)
_CACHE_FORMAT = 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on uint64 values (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (x ^ (x >> np.uint64(31))) & _MASK


def _hash_normal(key: int, ids: np.ndarray, width: int) -> np.ndarray:
    """Standard normal values ``(len(ids), width)`` determined by ``(key, id, column)`` (Box-Muller)."""
    base = _splitmix64(np.uint64(key) + ids.astype(np.uint64)[:, None] * np.uint64(2 * width + 1))
    column = np.arange(2 * width, dtype=np.uint64)
    bits = _splitmix64(base + column)
    uniform = ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
    first, second = uniform[:, :width], uniform[:, width:]
    return np.sqrt(-2.0 * np.log(first)) * np.cos(2.0 * math.pi * second)


@dataclass(frozen=True)
class _Field:
    """One categorical field of the planted model."""

    rows: int
    multiplier: int  # the bijection rank -> id: (multiplier * rank + offset) mod rows
    offset: int
    key: int
    bias_scale: float
    latent_scale: float
    table: np.ndarray | None  # (rows, latent_dim + 1) precomputed [beta, u] when the table is small


class _PlantedModel:
    """The hidden feature distributions and click model."""

    def __init__(self, cardinalities: tuple[int, ...], seed: int, exponent: float, latent_dim: int) -> None:
        rng = np.random.default_rng([seed, 0x5EED])
        self.exponent, self.latent_dim = exponent, latent_dim
        self.log_mean = rng.uniform(0.3, 3.0, NUM_INTEGER)
        self.log_std = rng.uniform(0.4, 1.4, NUM_INTEGER)
        self.missing = rng.uniform(0.0, 0.4, NUM_INTEGER)
        self.dense_weight = rng.normal(0.0, 1.0 / math.sqrt(NUM_INTEGER), NUM_INTEGER)
        self.projection = rng.normal(0.0, 1.0 / math.sqrt(NUM_INTEGER), (NUM_INTEGER, latent_dim))
        self.fields = []
        for rows in cardinalities:
            multiplier = int(rng.integers(1, max(rows, 2)))
            while math.gcd(multiplier, rows) != 1:
                multiplier += 1
            key = int(rng.integers(0, 2**63))
            table = _hash_normal(key, np.arange(rows), latent_dim + 1) if rows <= _TABLE_LIMIT else None
            self.fields.append(
                _Field(
                    rows=rows,
                    multiplier=multiplier,
                    offset=int(rng.integers(0, rows)),
                    key=key,
                    bias_scale=float(rng.uniform(0.1, 0.6)),
                    latent_scale=float(rng.uniform(0.2, 1.0)),
                    table=table,
                )
            )
        self.scale, self.intercept = 1.0, 0.0

    def features(self, rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Dense features ``(count, 13)`` float32 (``log(1 + max(n, 0))`` of counts), ids ``(count, 26)``."""
        counts = np.floor(np.expm1(rng.normal(self.log_mean, self.log_std, (count, NUM_INTEGER))))
        counts[rng.random((count, NUM_INTEGER)) < self.missing] = 0.0
        counts[:, 1] -= 2.0  # like Criteo's I2, the second column has small negative values
        dense = np.log1p(np.maximum(counts, 0.0)).astype(np.float32)
        ids = np.empty((count, len(self.fields)), dtype=np.int32)
        uniform = rng.random((count, len(self.fields)))
        for column, field in enumerate(self.fields):
            ids[:, column] = self._zipf_ids(uniform[:, column], field)
        return dense, ids

    def _zipf_ids(self, uniform: np.ndarray, field: _Field) -> np.ndarray:
        """Bounded-Zipf ranks by the inverse CDF of the continuous power law on ``[1, rows + 1)``, mapped to
        ids by the field's bijection."""
        power = 1.0 - self.exponent
        top = (field.rows + 1.0) ** power
        rank = np.floor(((top - 1.0) * uniform + 1.0) ** (1.0 / power)).astype(np.int64) - 1
        rank = np.clip(rank, 0, field.rows - 1)
        return (rank * field.multiplier + field.offset) % field.rows

    def raw_logits(self, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The click model's logit before scaling and intercept: ``(count,)`` float64."""
        standard = (dense - self.log_mean * (1.0 - self.missing)) / self.log_std
        logit = standard @ self.dense_weight
        vector = standard @ self.projection
        total, squares = vector.copy(), np.sum(vector**2, axis=1)
        for column, field in enumerate(self.fields):
            values = (
                field.table[ids[:, column]]
                if field.table is not None
                else _hash_normal(field.key, ids[:, column], self.latent_dim + 1)
            )
            logit += field.bias_scale * values[:, 0]
            latent = field.latent_scale * values[:, 1:] / math.sqrt(self.latent_dim)
            total += latent
            squares += np.sum(latent**2, axis=1)
        pairs = 0.5 * (np.sum(total**2, axis=1) - squares) / math.sqrt(len(self.fields))
        return logit + pairs

    def calibrate(self, dense: np.ndarray, ids: np.ndarray, signal: float, click_rate: float) -> None:
        """Scale the logit's standard deviation to ``signal`` and set the intercept for ``click_rate``
        (bisection on the mean click probability of the pilot rows)."""
        raw = self.raw_logits(dense, ids)
        self.scale = signal / max(float(np.std(raw)), 1e-12)
        scaled = self.scale * (raw - raw.mean())
        low, high = -30.0, 30.0
        for _ in range(80):
            middle = 0.5 * (low + high)
            rate = np.mean(1.0 / (1.0 + np.exp(-(scaled + middle))))
            low, high = (middle, high) if rate < click_rate else (low, middle)
        self.intercept = 0.5 * (low + high) - self.scale * raw.mean()

    def logits(self, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Planted logits ``(count,)`` float64."""
        return self.intercept + self.scale * self.raw_logits(dense, ids)


@dataclass(frozen=True)
class SyntheticCriteo:
    """A synthetic click log: ``data`` (every row), table sizes, and the planted ``logits`` ``(N,)``."""

    data: ClickData
    cardinalities: tuple[int, ...]
    logits: np.ndarray

    def splits(self) -> dict[str, ClickData]:
        """``{"train", "validation", "test"}`` by the Criteo reference's split by line order."""
        ranges = split_by_line_order(len(self.data))
        return {name: self.data.rows(r.start, r.stop) for name, r in ranges.items()}


def _check(value: object, name: str, low: float, high: float, kind: type) -> None:
    allowed = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, allowed) or not low <= value <= high:
        raise ValueError(f"{name} must be {_ARTICLE[kind]} {kind.__name__} in [{low}, {high}], got {value!r}")


_ARTICLE = {int: "an", float: "a"}


def synthetic_criteo(
    rows: int,
    *,
    seed: int = 0,
    max_table_rows: int | None = None,
    zipf_exponent: float = 1.05,
    latent_dim: int = 4,
    signal: float = 1.5,
    click_rate: float = 0.25,
    cache_dir: str | os.PathLike | None = None,
) -> SyntheticCriteo:
    """Generate ``rows`` samples.

    Args:
        rows: number of samples.
        seed: seed of the model and the samples.
        max_table_rows: cap on each table's rows (None: the full Kaggle sizes, up to 10.1M rows).
        zipf_exponent: power-law exponent ``s > 1`` of the id frequencies.
        latent_dim: size of the hidden latent vectors.
        signal: standard deviation of the planted logit (larger: clicks easier to predict).
        click_rate: mean click probability.
        cache_dir: keep the arrays as ``.npy`` files in a sub-folder named by the settings, written block
            by block and opened as memmaps by later calls; None: generate in memory.
    """
    _check(rows, "rows", 1, 2**31 - 1, int)
    _check(seed, "seed", 0, 2**63 - 1, int)
    if max_table_rows is not None:
        _check(max_table_rows, "max_table_rows", 1, 2**31 - 1, int)
    _check(zipf_exponent, "zipf_exponent", 1.0001, 10.0, float)
    _check(latent_dim, "latent_dim", 1, 256, int)
    _check(signal, "signal", 0.0, 20.0, float)
    _check(click_rate, "click_rate", 1e-4, 1 - 1e-4, float)
    cap = max_table_rows or max(KAGGLE_CARDINALITIES)
    cardinalities = tuple(min(n, cap) for n in KAGGLE_CARDINALITIES)
    settings = (rows, seed, cap, float(zipf_exponent), latent_dim, float(signal), float(click_rate))
    if cache_dir is None:
        arrays = {name: np.empty(shape, dtype) for name, (shape, dtype) in _layout(rows).items()}
        _fill(arrays, cardinalities, *settings[1:])
    else:
        arrays = _cached(Path(cache_dir), settings, cardinalities)
    data = ClickData(arrays["dense"], arrays["ids"], arrays["labels"])
    return SyntheticCriteo(data, cardinalities, arrays["logits"])


def _layout(rows: int) -> dict[str, tuple[tuple[int, ...], type]]:
    return {
        "dense": ((rows, NUM_INTEGER), np.float32),
        "ids": ((rows, NUM_CATEGORICAL), np.int32),
        "labels": ((rows,), np.uint8),
        "logits": ((rows,), np.float32),
    }


def _fill(
    arrays: dict[str, np.ndarray],
    cardinalities: tuple[int, ...],
    seed: int,
    cap: int,
    zipf_exponent: float,
    latent_dim: int,
    signal: float,
    click_rate: float,
) -> None:
    """Write the samples into ``arrays`` block by block."""
    rows = arrays["labels"].shape[0]
    model = _PlantedModel(cardinalities, seed, zipf_exponent, latent_dim)
    model.calibrate(*model.features(np.random.default_rng([seed, 0x9170]), _PILOT_ROWS), signal, click_rate)
    for block, start in enumerate(range(0, rows, _BLOCK)):
        stop = min(start + _BLOCK, rows)
        rng = np.random.default_rng([seed, block])
        block_dense, block_ids = model.features(rng, _BLOCK)
        block_logits = model.logits(block_dense[: stop - start], block_ids[: stop - start])
        draws = rng.random(_BLOCK)[: stop - start]
        arrays["dense"][start:stop] = block_dense[: stop - start]
        arrays["ids"][start:stop] = block_ids[: stop - start]
        arrays["logits"][start:stop] = block_logits
        arrays["labels"][start:stop] = draws < 1.0 / (1.0 + np.exp(-block_logits))


def _cached(cache_dir: Path, settings: tuple, cardinalities: tuple[int, ...]) -> dict[str, np.ndarray]:
    """The arrays of ``settings`` from ``cache_dir``, generated into a temporary folder first if missing or
    damaged."""
    key = hashlib.sha256(json.dumps([_CACHE_FORMAT, *settings]).encode()).hexdigest()[:20]
    folder = cache_dir / f"synthetic-criteo-{settings[0]}-{key}"
    layout = _layout(settings[0])
    arrays = read_entry(folder, lambda entry: _open_arrays(entry, layout), folder=True)
    if arrays is not None:
        return arrays
    with building_folder(folder) as work:
        arrays = {
            name: np.lib.format.open_memmap(work / f"{name}.npy", mode="w+", dtype=dtype, shape=shape)
            for name, (shape, dtype) in layout.items()
        }
        _fill(arrays, cardinalities, *settings[1:])
        for array in arrays.values():
            array.flush()
        del arrays
        (work / "done").touch()
    return _open_arrays(folder, layout)


def _open_arrays(folder: Path, layout: dict[str, tuple[tuple[int, ...], type]]) -> dict[str, np.ndarray]:
    """The arrays of ``layout`` in the cache folder ``folder`` as memmaps; ``ValueError`` naming the file
    that is missing, damaged or of another shape."""
    if not (folder / "done").is_file():
        raise ValueError(f"{folder / 'done'} is missing: the arrays were not completed")
    arrays = {}
    for name, (shape, dtype) in layout.items():
        file = folder / f"{name}.npy"
        try:
            array = np.load(file, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError) as error:
            raise ValueError(f"{file} is not a .npy array: {error}") from None
        if array.shape != shape or array.dtype != dtype:
            raise ValueError(f"{file} holds {array.dtype} {array.shape}, not {np.dtype(dtype)} {shape}")
        arrays[name] = array
    return arrays
