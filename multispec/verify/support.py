"""Draft distributions kept over the drafter's own vocabulary.

A drafter with a restricted output (the draft head reads out 4,096 of the target's 49,152 tokens)
draws from rows that are zero outside its vocabulary. Stored dense, every drafted node costs a row
of the full vocabulary written with zeros, and a step of 16 samples drafting 4 deep fills 12 MB
that verification mostly never reads: the accept test of a drawn token reads one entry of its row,
and only the rows where a drawn token is rejected are read whole (for the residual).
``SupportQ`` keeps the values over the support and hands out entries, or dense rows for the few
rows read whole: the same numbers as the dense rows, so verification is unchanged bit for bit.

The helpers take either form (a dense ``[R, V]`` tensor or a ``SupportQ``), so code that reads q
does not branch on it.
"""

from __future__ import annotations

import torch


class SupportQ:
    """Rows of q ``[R, V]`` stored as ``values [R, K]`` over the columns ``support [K]`` (distinct
    token ids; every other column is 0). ``column [V]`` maps a token to its column of ``values``
    (-1 off the support); it is built once per support and shared by the rows taken from it."""

    __slots__ = ("values", "support", "vocab_size", "_column")

    def __init__(self, values: torch.Tensor, support: torch.Tensor, vocab_size: int,
                 column: torch.Tensor | None = None):
        if values.dim() != 2 or values.shape[1] != support.numel():
            raise ValueError(f"q values must be [R, K] with K = {support.numel()} support tokens, "
                             f"got shape {tuple(values.shape)}")
        self.values, self.support, self.vocab_size = values, support, vocab_size
        self._column = column

    @staticmethod
    def columns(support: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The token -> column map of ``support`` (-1 off it)."""
        column = torch.full((vocab_size,), -1, dtype=torch.long, device=support.device)
        column[support] = torch.arange(support.numel(), device=support.device)
        return column

    @property
    def column(self) -> torch.Tensor:
        if self._column is None:
            self._column = self.columns(self.support, self.vocab_size)
        return self._column

    @property
    def shape(self) -> tuple[int, int]:
        return (self.values.shape[0], self.vocab_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    def __len__(self) -> int:
        return self.values.shape[0]

    def rows(self, index) -> SupportQ:
        """The rows ``index`` (a list or a long tensor), still over the support."""
        return SupportQ(self.values[index], self.support, self.vocab_size, self._column)

    def dense(self, index=None) -> torch.Tensor:
        """Rows ``index`` (None: all; any shape of long tensor) over the full vocabulary ``[..., V]``."""
        values = self.values if index is None else self.values[index]
        out = values.new_zeros(*values.shape[:-1], self.vocab_size)
        out.index_copy_(out.dim() - 1, self.support, values)
        return out

    def at(self, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """q of ``tokens`` at ``rows`` (0 off the support)."""
        column = self.column[tokens]
        found = self.values[rows, column.clamp_min(0)]
        return torch.where(column >= 0, found, torch.zeros((), dtype=found.dtype, device=found.device))

    def to(self, device) -> SupportQ:
        return SupportQ(self.values.to(device), self.support.to(device), self.vocab_size,
                        None if self._column is None else self._column.to(device))


def dense_rows(q: torch.Tensor | SupportQ, index=None) -> torch.Tensor:
    """Rows ``index`` of q (None: all) over the full vocabulary."""
    if isinstance(q, SupportQ):
        return q.dense(index)
    return q if index is None else q[index]


def entries(q: torch.Tensor | SupportQ, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``q[rows, tokens]``."""
    if isinstance(q, SupportQ):
        return q.at(rows, tokens)
    return q[rows, tokens]


def select_rows(q: torch.Tensor | SupportQ, index) -> torch.Tensor | SupportQ:
    """Rows ``index`` of q, in q's own form."""
    return q.rows(index) if isinstance(q, SupportQ) else q[index]


def concat_rows(parts: list) -> torch.Tensor | SupportQ:
    """The rows of ``parts`` one after another: a ``SupportQ`` where all share one support, else
    dense. Rows that lie one after another in one storage (a drafter that fills all its trees' q
    at once and splits it) are joined without a copy."""
    if all(isinstance(part, SupportQ) for part in parts):
        first = parts[0]
        if all(part.support is first.support or torch.equal(part.support, first.support) for part in parts[1:]):
            values = [part.values for part in parts]
            joined = adjacent(values)
            return SupportQ(joined if joined is not None else torch.cat(values), first.support, first.vocab_size,
                            next((part._column for part in parts if part._column is not None), None))
    dense = [dense_rows(part) for part in parts]
    joined = adjacent(dense)
    return joined if joined is not None else torch.cat(dense)


def adjacent(rows: list[torch.Tensor]) -> torch.Tensor | None:
    """The rows as one tensor without a copy where they lie one after another in one storage:
    what ``torch.cat`` would return, a view. None where they do not."""
    first = rows[0]
    if len(rows) == 1:
        return first
    if first.dim() != 2 or not all(r.is_contiguous() for r in rows):
        return None
    storage, size = first.untyped_storage().data_ptr(), first.element_size()
    end = first.data_ptr() + first.numel() * size
    for r in rows[1:]:
        if (r.dtype != first.dtype or r.device != first.device or r.shape[1:] != first.shape[1:]
                or r.untyped_storage().data_ptr() != storage or r.data_ptr() != end):
            return None
        end += r.numel() * size
    return first.as_strided((sum(r.shape[0] for r in rows), first.shape[1]), (first.shape[1], 1))
