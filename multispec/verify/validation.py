"""Input checks that turn silent garbage into a ValueError naming the problem.

They cost one pass over the probabilities (a minimum and a row sum), which is cheap next to a
forward but not free, so every public entry point takes ``validate=True`` and the engine's hot path
may pass ``validate=False`` once its inputs are known to be well formed.
"""

import torch


def tolerance(x: torch.Tensor) -> float:
    """How far a row sum may stray from 1: loose enough for a float32 softmax over 49k tokens."""
    return 2e-2 if torch.finfo(x.dtype).bits <= 16 else 1e-3


def check_distribution(name: str, x: torch.Tensor, vocab_size: int | None = None) -> None:
    """Raise unless ``x`` is a floating tensor of probability rows over the last dimension."""
    if not torch.is_floating_point(x):
        raise ValueError(f"{name} must be a floating tensor of probabilities, got dtype {x.dtype}")
    if vocab_size is not None and x.shape[-1] != vocab_size:
        raise ValueError(f"{name} has vocabulary size {x.shape[-1]}, expected {vocab_size}")
    if x.numel() == 0:
        return
    # Two passes: a NaN or infinity makes its row sum non-finite, so the sums catch those too.
    if float(x.min()) < 0:
        raise ValueError(f"{name} has negative probabilities")
    error = (x.sum(-1) - 1).abs()
    worst = float(error.max())
    if not worst <= tolerance(x):
        raise ValueError(f"{name} rows must sum to 1 (largest error {worst:.3g}; NaN means non-finite entries)")


def check_integer(name: str, x: torch.Tensor, dims: int) -> None:
    """Raise unless ``x`` is an integer tensor with ``dims`` dimensions."""
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {x.dtype}")
    if x.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimension(s), got shape {tuple(x.shape)}")


def check_candidates(candidates: torch.Tensor, vocab_size: int) -> None:
    """Raise unless ``candidates`` [N, K] holds K >= 1 token ids per row, -1 padding at the end."""
    check_integer("candidates", candidates, 2)
    if candidates.shape[1] == 0:
        raise ValueError("candidates: K = 0; a node needs at least one draft token")
    if candidates.numel() == 0:
        return
    if bool((candidates < -1).any()) or bool((candidates >= vocab_size).any()):
        raise ValueError(f"candidates: token ids must lie in [0, {vocab_size}) (or -1 as padding)")
    if bool((candidates[:, 0] < 0).any()):
        raise ValueError("candidates: a row has no draft token (K = 0 for that row)")
    padded = candidates < 0
    if bool((padded[:, :-1] & ~padded[:, 1:]).any()):
        raise ValueError("candidates: -1 padding must come after all draft tokens of a row")


def check_rows(name: str, x: torch.Tensor, n: int) -> None:
    """Raise unless ``x`` has 1 row (shared) or ``n`` rows (one per candidate row)."""
    if x.shape[0] not in (1, n):
        raise ValueError(f"{name} has {x.shape[0]} rows; expected 1 or {n} (one per candidate row)")


def check_token_inputs(p: torch.Tensor, candidates: torch.Tensor, q: torch.Tensor | None, q_dims: tuple[int, ...]) -> None:
    """Shapes and values of a token-level scheme's inputs; ``q_dims`` lists accepted q ranks."""
    if p.dim() != 2:
        raise ValueError(f"p must be [rows, V], got shape {tuple(p.shape)}")
    check_distribution("p", p)
    check_candidates(candidates, p.shape[1])
    check_rows("p", p, candidates.shape[0])
    if not q_dims:
        return
    if q is None:
        raise ValueError("q is required by this scheme (the draft distributions)")
    if q.dim() not in q_dims:
        raise ValueError(f"q must have {' or '.join(map(str, q_dims))} dimensions, got shape {tuple(q.shape)}")
    check_distribution("q", q, p.shape[1])
    check_rows("q", q, candidates.shape[0])
    if q.dim() == 3 and q.shape[1] != candidates.shape[1]:
        raise ValueError(f"q has {q.shape[1]} draft rows per node but candidates has K = {candidates.shape[1]}")
