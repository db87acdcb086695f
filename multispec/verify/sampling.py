"""Random draws shared by the verification schemes, and where their random numbers come from.

A scheme asks :class:`Uniforms` for one uniform per row for each *purpose* it has (the draw of an
output token, the accept test of candidate k, the k-th round of a selection tournament). Two
sources answer:

- keyed (the engine): the uniform is a hash of the row's 64-bit key and the purpose, a
  counter-based generator in the manner of Philox or Threefry: no state, nothing consumed. The
  engine keys a row by (request seed, sample index, output position), so the random numbers that
  decide a sample's token at a position are the same whatever else shares the batch, whatever was
  drafted and in whatever order requests were admitted. With drafts that carry no distribution the
  token at each position is then y ~ p drawn with that position's own numbers, exactly the token
  plain sampling draws: a seeded speculative run repeats the seeded plain run token for token.
- streamed (tests, analysis): uniforms come from a ``torch.Generator`` in call order.

Every draw from a (residual) distribution goes through :func:`sample_rows`; it is the single place
where the tests plant a bias to show that their statistical checks have power. (On a CPU a step
without drafts whose probabilities nobody else reads, and a step whose samples all verify copied
drafts, draw in the compiled softmax's own pass instead, ``softmax_draw``: the same code as
``softmax_rows`` then this, bit for bit; the engine tests check both against this path.)
"""

from __future__ import annotations

import functools

import numpy as np
import torch

TOKEN = 0
"""Purpose of the draw that picks an output token from p or from a residual."""
TEST = 1
"""Purpose of the accept test of candidate k (``k`` = the candidate's column)."""
ROUND = 2
"""Purpose of the k-th round of a selection tournament."""
DRAFT = 3
"""Purpose of the k-th draw of a sampled draft rooted at a position (drafters, not verification)."""

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK = (1 << 64) - 1


_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijection of 64-bit words whose outputs pass BigCrush. Returns a
    new array (``x`` is not changed); the steps after the first work in place on it."""
    x = x ^ (x >> _S30)
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


def _words(value) -> np.ndarray:
    """An int or integer array as a uint64 array of at least one dimension (negative ints taken
    modulo 2**64)."""
    if isinstance(value, int):
        return np.asarray([value & _MASK], dtype=np.uint64)
    return np.atleast_1d(np.asarray(value)).astype(np.uint64)


def derive(keys, *words) -> np.ndarray:
    """Keys (uint64) derived from ``keys`` and each word in turn (ints or integer arrays, which
    broadcast against each other).

    Each step mixes the word into the key, so keys that differ in any word are unrelated: a
    sample's key from (seed, index), a position's from (sample key, position), a draw's from
    (position key, purpose, k).
    """
    out = _mix(_words(keys) ^ _GOLDEN)
    for word in words:
        out = _mix(out + (_mixed_int(word) if isinstance(word, int) else _mix(_words(word) + _GOLDEN)))
    return out


@functools.lru_cache(maxsize=4096)
def _mixed_int(word: int) -> np.ndarray:
    """``_mix(_words(word) + _GOLDEN)`` of an int word (a purpose, a candidate's column): the same
    few values on every draw of a step, so kept rather than mixed again."""
    mixed = _mix(_words(word) + _GOLDEN)
    mixed.flags.writeable = False
    return mixed


def sample_key(seed: int, index: int) -> int:
    """The key of sample ``index`` of a request seeded with ``seed``."""
    return int(derive(seed, index)[0])


def keyed_uniforms(keys: np.ndarray, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """U[0, 1) from 64-bit keys [N], with the full resolution of ``dtype`` and never 1.0."""
    if dtype == torch.float64:
        return torch.from_numpy((keys >> np.uint64(11)).astype(np.float64) * 2.0**-53)
    return torch.from_numpy((keys >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)).to(dtype)


class Uniforms:
    """The random numbers of N rows: one U[0, 1) per row for each (purpose, k) a scheme asks for.

    Keyed: a row's uniform for a (purpose, k) is fixed by its key, so a scheme must ask for each
    (purpose, k) at most once per row (two different values need two different k). Streamed: each
    call draws fresh numbers from the generator.
    """

    def __init__(self, n: int, *, keys: np.ndarray | None = None, generator: torch.Generator | None = None):
        if keys is not None and len(keys) != n:
            raise ValueError(f"{len(keys)} keys for {n} rows")
        self.n = n
        self.keys = keys
        self.generator = generator

    @classmethod
    def of(cls, rng: Uniforms | torch.Generator | None, n: int) -> Uniforms:
        """``rng`` as the uniforms of ``n`` rows (a generator, or None for torch's global one)."""
        if isinstance(rng, Uniforms):
            if rng.n != n:
                raise ValueError(f"random numbers for {rng.n} rows given to {n} rows")
            return rng
        return cls(n, generator=rng)

    def draw(self, purpose: int, k: int, like: torch.Tensor) -> torch.Tensor:
        """[N] uniforms for (purpose, k), in ``like``'s dtype and on its device."""
        if self.keys is None:
            return torch.rand(self.n, generator=self.generator, device=like.device, dtype=like.dtype)
        return keyed_uniforms(derive(self.keys, purpose, k), like.dtype).to(like.device)

    def rows(self, index: torch.Tensor) -> Uniforms:
        """The uniforms of the rows ``index`` (a [M] long tensor) of these N."""
        if self.keys is None:
            return Uniforms(int(index.numel()), generator=self.generator)
        return Uniforms(int(index.numel()), keys=self.keys[index.cpu().numpy()])


class PositionKeys:
    """What keys a tree walk's draws: sample b decides output position ``start[b] + depth`` at a depth.

    ``sample_keys`` [B] uint64 (see :func:`sample_key`), ``start`` [B] the output position each
    sample's next token takes (its number of output tokens so far)."""

    def __init__(self, sample_keys: np.ndarray, start: np.ndarray):
        self.sample_keys = np.asarray(sample_keys, dtype=np.uint64)
        self.start = np.asarray(start, dtype=np.int64)

    def at(self, rows: torch.Tensor, depth: int) -> Uniforms:
        """The uniforms of samples ``rows`` deciding the token ``depth`` steps past their start."""
        index = rows.cpu().numpy()
        return Uniforms(len(index), keys=derive(self.sample_keys[index], self.start[index] + depth))

    def draft_uniforms(self, count: int) -> np.ndarray:
        """[B, count] float64 uniforms for sampled drafts rooted at each sample's start: keyed by
        the same position as its verification draws, with their own purpose, so the two never meet."""
        position = derive(self.sample_keys, self.start)[:, None]
        return keyed_uniforms(derive(position, DRAFT, np.arange(count)[None, :]).reshape(-1)).numpy().reshape(
            len(self.start), count)


BLOCK = 64
"""Entries per block of the two-level inverse-CDF search in :func:`sample_rows`."""


def sample_rows(
    weights: torch.Tensor,
    rng: Uniforms | torch.Generator | None,
    fallback: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw one index per row of ``weights`` [N, V] with probability proportional to the row.

    Inverse-CDF sampling with one uniform per row (purpose ``TOKEN``), cheaper over a 49k
    vocabulary than Gumbel noise or ``torch.multinomial``. The cumulative sum is taken in two
    levels: the sums of blocks of ``BLOCK`` entries (one vectorised pass over the row), their
    running total in float64 to find the block where ``u * total`` falls, then a running sum
    inside that block only. A full-row ``cumsum`` is a sequential pass that cost 5x as much at 128
    rows. ``weights`` may be one row [1, V] shared by the N rows of ``rng`` (a prompt's n
    samples). A row whose weights sum to zero is only reachable through rounding (an
    analytically vanishing residual); it draws from the same row of ``fallback`` instead (usually
    the target distribution itself).
    """
    n = rng.n if isinstance(rng, Uniforms) else weights.shape[0]
    rng = Uniforms.of(rng, n)
    compiled = _compiled(weights)
    if compiled is not None:
        # The same search as below in one compiled call (block sums may round differently).
        u = rng.draw(TOKEN, 0, _FLOAT64)
        index, empty = compiled(weights.contiguous(), u)
        if fallback is not None and bool(empty.any()):
            rows = empty.nonzero().squeeze(1)
            rows_fallback = fallback if fallback.shape[0] == 1 else fallback[rows]
            index[rows] = compiled(rows_fallback.to(torch.float32).contiguous(), u[rows].contiguous())[0]
        return index
    blocked = _blocked(weights)
    cumulative = blocked.sum(-1).double().cumsum(-1)
    total = cumulative[:, -1]
    if fallback is not None:
        empty = total <= 0
        if bool(empty.any()):
            blocked = _blocked(torch.where(empty[:, None], fallback, weights))
            cumulative = blocked.sum(-1).double().cumsum(-1)
            total = cumulative[:, -1]
    u = rng.draw(TOKEN, 0, total)
    if blocked.shape[0] == 1 and n != 1:
        blocked, total = blocked.expand(n, -1, -1), total.expand(n)
        cumulative = cumulative.expand(n, -1).contiguous()  # [N, V / BLOCK]: small
    target = u * total
    last = blocked.shape[1] - 1
    # The block: the first whose running total exceeds the target (right=True: an empty block never
    # does). u * total can round up to total; those rows take the last block, below.
    block = torch.searchsorted(cumulative, target[:, None], right=True).squeeze(1)
    over = block > last
    block = block.clamp_(max=last)
    before = torch.where(block > 0, cumulative.gather(1, (block - 1).clamp_min(0)[:, None]).squeeze(1),
                         torch.zeros_like(target))
    local = blocked[torch.arange(n, device=blocked.device), block]  # [N, BLOCK]
    # Inside the block: the first entry whose running sum exceeds target - before (>= 0, so a
    # zero-weight entry is never chosen).
    index = torch.searchsorted(local.double().cumsum(-1), (target - before)[:, None], right=True).squeeze(1)
    # The block's own running sum can fall short of its vectorised sum by rounding, and a target at
    # the total falls past every block: take the block's last entry of positive weight.
    short = over | (index >= BLOCK)
    if bool(short.any()):
        positive = (local[short] > 0).flip(-1).int().argmax(-1)
        index[short] = BLOCK - 1 - positive
    return block * BLOCK + index


_FLOAT64 = torch.empty(0, dtype=torch.float64)


def _compiled(weights: torch.Tensor):
    """``torch.ops.multispec.sample_rows`` where it takes these weights (float32 on a CPU, the
    kernels built), else None."""
    if weights.device.type != "cpu" or weights.dtype != torch.float32 or weights.shape[1] == 0:
        return None
    from multispec import kernels

    return kernels.sample_rows()


def _blocked(weights: torch.Tensor) -> torch.Tensor:
    """[N, V] as [N, V / BLOCK, BLOCK], zero-padded where V is not a multiple of BLOCK."""
    pad = -weights.shape[1] % BLOCK
    if pad:
        weights = torch.nn.functional.pad(weights, (0, pad))
    return weights.reshape(weights.shape[0], -1, BLOCK)
