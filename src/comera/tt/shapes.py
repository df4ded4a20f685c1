"""Mode-size factorisation, padding suggestions and rank bounds for tensor-train layouts: a dimension ``n`` is
folded into ``num_modes`` modes with ``prod(n_k) == n``, or padded (:func:`suggest_padding`) when it folds
badly, the layers slicing the padding off. Details: docs/method.md section 2."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

__all__ = [
    "factorize",
    "suggest_padding",
    "auto_num_modes",
    "auto_modes",
    "max_ranks",
    "requested_ranks",
    "resolve_ranks",
    "check_modes",
]

_TYPICAL_MODE = 16
_BALANCE_SLACK = 1.5


def _check_positive_int(value: object, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value


@lru_cache(maxsize=4096)
def _best_factorization(n: int, num_modes: int, smallest: int) -> tuple[int, ...] | None:
    """Non-decreasing factors >= ``smallest`` with product ``n`` minimising (max factor, -min factor)."""
    if num_modes == 1:
        return (n,) if n >= smallest else None
    best: tuple[int, ...] | None = None
    best_key: tuple[int, int] | None = None
    f = smallest
    while f**num_modes <= n:
        if n % f == 0:
            rest = _best_factorization(n // f, num_modes - 1, f)
            if rest is not None:
                candidate = (f, *rest)
                key = (candidate[-1], -candidate[0])
                if best_key is None or key < best_key:
                    best, best_key = candidate, key
        f += 1
    return best


def factorize(n: int, num_modes: int) -> tuple[int, ...]:
    """Balanced factorisation of ``n`` into ``num_modes`` factors, sorted ascending, minimising the largest
    factor (then maximising the smallest); factors of 1 only when ``n`` has too few prime factors.

    Args:
        n: the size to fold, ``n >= 1``.
        num_modes: number of modes, ``num_modes >= 1``.

    Returns:
        ``num_modes`` ascending ints whose product is ``n``.

    Examples:
        >>> import comera
        >>> comera.factorize(768, 3)
        (8, 8, 12)
        >>> comera.factorize(97, 2)  # a prime folds badly: see suggest_padding
        (1, 97)
    """
    _check_positive_int(n, "n")
    _check_positive_int(num_modes, "num_modes")
    result = _best_factorization(n, num_modes, 1)
    assert result is not None  # (1, ..., 1, n) always exists
    return result


def _balanced_limit(n: int, num_modes: int) -> int:
    return max(2, math.ceil(_BALANCE_SLACK * n ** (1.0 / num_modes)))


def suggest_padding(n: int, num_modes: int, max_factor: int | None = None) -> int:
    """Smallest ``n' >= n`` whose balanced factorisation into ``num_modes`` has factors <= ``max_factor``
    (default ``ceil(1.5 * n ** (1 / num_modes))``); ``n`` itself when it already folds well.

    Examples:
        >>> import comera
        >>> comera.suggest_padding(97, 2)
        98
        >>> comera.suggest_padding(768, 3)
        768
    """
    _check_positive_int(n, "n")
    _check_positive_int(num_modes, "num_modes")
    limit = (
        _balanced_limit(n, num_modes) if max_factor is None else _check_positive_int(max_factor, "max_factor")
    )
    if limit**num_modes < n:
        raise ValueError(f"max_factor must satisfy max_factor ** num_modes >= n ({n}), got {limit}")
    candidate = n
    while factorize(candidate, num_modes)[-1] > limit:
        candidate += 1
    return candidate


def auto_num_modes(n: int) -> int:
    """Number of modes chosen for a dimension ``n`` when none is given: modes of about 16 or less."""
    _check_positive_int(n, "n")
    return max(1, math.ceil(math.log(n) / math.log(_TYPICAL_MODE) - 1e-9))


def auto_modes(n: int, num_modes: int | None = None, descending: bool = False) -> tuple[int, ...]:
    """Modes for dimension ``n``: padded when ``n`` folds badly, balanced, ascending (or descending).

    Examples:
        >>> import comera
        >>> comera.auto_modes(768, 3)
        (8, 8, 12)
        >>> comera.auto_modes(97, 2)  # 97 is prime: padded to 98 = 7 x 14
        (7, 14)
        >>> comera.auto_modes(768, 3, descending=True)
        (12, 8, 8)
    """
    num_modes = auto_num_modes(n) if num_modes is None else _check_positive_int(num_modes, "num_modes")
    modes = factorize(suggest_padding(n, num_modes), num_modes)
    return tuple(reversed(modes)) if descending else modes


def check_modes(
    modes: Sequence[int], features: int, name: str, allow_padding: bool = False
) -> tuple[int, ...]:
    """Validate user-given modes against a dimension (product equal to ``features``, or at least it with
    ``allow_padding``); returns them as a tuple of ints."""
    if isinstance(modes, int) or not isinstance(modes, Sequence) or len(modes) == 0:
        raise ValueError(f"{name} must be a non-empty sequence of positive ints, got {modes!r}")
    modes = tuple(modes)
    for m in modes:
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"{name} must contain positive ints, got {modes!r}")
    product = math.prod(modes)
    if allow_padding:
        if product < features:
            raise ValueError(f"prod({name}) = {product} must be >= {features}, got {name}={modes}")
    elif product != features:
        raise ValueError(
            f"prod({name}) = {product} must equal {features}; got {name}={modes}. "
            f"comera.factorize({features}, {len(modes)}) gives {factorize(features, len(modes))}"
        )
    return modes


def max_ranks(bond_sizes: Sequence[int]) -> tuple[int, ...]:
    """Largest useful rank of each inner bond (``len - 1`` ints) of a train whose cores carry ``bond_sizes``
    entries per slice (TT: ``n_k``, TTM: ``m_k * n_k``):
    ``min(prod(bond_sizes[:k+1]), prod(bond_sizes[k+1:]))``."""
    sizes = list(bond_sizes)
    bounds = []
    for k in range(1, len(sizes)):
        bounds.append(min(math.prod(sizes[:k]), math.prod(sizes[k:])))
    return tuple(bounds)


def requested_ranks(rank: int | Sequence[int], bonds: int) -> tuple[int, ...]:
    """The per-bond ranks a user ``rank`` asks for on a train of ``bonds`` inner bonds, not clipped: an int
    (the same on every bond), a sequence with one entry per bond, or the boundary-inclusive form ``(1, r_1,
    ..., r_bonds, 1)``. Raises ``ValueError`` naming what is wrong otherwise."""
    if isinstance(rank, bool):
        raise ValueError(f"rank must be a positive int or a sequence of positive ints, got {rank!r}")
    if isinstance(rank, int):
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        return (rank,) * bonds
    if not isinstance(rank, Sequence):
        raise ValueError(f"rank must be a positive int or a sequence of positive ints, got {rank!r}")
    requested = tuple(rank)
    if len(requested) == bonds + 2 and requested[0] == requested[-1] == 1:
        requested = requested[1:-1]
    if len(requested) != bonds:
        raise ValueError(
            f"rank must have {bonds} entries (one per bond) or {bonds + 2} with boundary 1s, "
            f"got {len(requested)}: {rank!r}"
        )
    for r in requested:
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"rank entries must be ints >= 1, got {rank!r}")
    return requested


def resolve_ranks(rank: int | Sequence[int], bond_sizes: Sequence[int]) -> tuple[int, ...]:
    """Per-bond ranks from a user ``rank`` (an int, one per inner bond, or ``(1, r_1, ..., r_{K-1}, 1)``),
    clipped to :func:`max_ranks` and to the neighbours (``r_k <= r_{k-1} c_k``, ``r_k <= c_{k+1} r_{k+1}``),
    so every unfolding has full rank available, as TT-SVD needs."""
    bounds = max_ranks(bond_sizes)
    requested = requested_ranks(rank, len(bounds))
    clipped = [min(r, b) for r, b in zip(requested, bounds)]
    sizes = list(bond_sizes)
    for k in range(len(clipped)):
        clipped[k] = min(clipped[k], (clipped[k - 1] if k else 1) * sizes[k])
    for k in reversed(range(len(clipped))):
        clipped[k] = min(clipped[k], sizes[k + 1] * (clipped[k + 1] if k + 1 < len(clipped) else 1))
    return tuple(clipped)
