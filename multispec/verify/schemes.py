"""The one registry of verification schemes: each token-level rule with what it requires of its drafts.

Whether a scheme is lossless depends on the joint law of the drafts it is given, which only the
drafter knows: recursive rejection without replacement is exact only for siblings drawn without
replacement, SpecTr and the canonical decomposition only for i.i.d. siblings, every q-based rule
only for drafts that carry the q they were drawn from, greedy acceptance only at temperature 0. So
every scheme declares its preconditions here, every drafter declares the law of its drafts
(:class:`DraftLaw`), and :func:`check_drafts` refuses a pairing that would not be exact before
anything runs. Adding a scheme is one entry in ``SCHEMES``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from multispec.verify.canonical import canonical_select
from multispec.verify.direct import deterministic_select, greedy_select
from multispec.verify.recursive import recursive_rejection
from multispec.verify.speculative import single_draft
from multispec.verify.spectr import spectr_select

COPIED = "copied"
"""Drafts without a distribution (text copied from elsewhere, argmax chains)."""
IID = "iid"
"""Siblings drawn i.i.d. (with replacement) from one distribution: their q rows are equal."""
INDEPENDENT = "independent"
"""Siblings drawn independently, each from its own q row."""
WITHOUT_REPLACEMENT = "without_replacement"
"""Siblings drawn one after another without replacement from the first sibling's q row."""
MIXED = "mixed"
"""Siblings drawn without replacement from the first sibling's q row, then copied ones (no q) after
them: the hybrid drafter's head candidates beside sibling text."""
SAMPLED_LAWS = (IID, INDEPENDENT, WITHOUT_REPLACEMENT, MIXED)

AUTO = "auto"
_PHRASE = {COPIED: "copied (no q)", IID: "i.i.d. with replacement", INDEPENDENT: "independently",
           WITHOUT_REPLACEMENT: "without replacement", MIXED: "without replacement next to copied ones"}


@dataclass(frozen=True)
class DraftLaw:
    """How a drafter's trees are drawn: the joint law of siblings (``COPIED`` or one of
    ``SAMPLED_LAWS``) and ``width``, the most children any node can get."""

    law: str
    width: int

    @property
    def sampled(self) -> bool:
        return self.law != COPIED


@dataclass(frozen=True)
class Scheme:
    """A token-level rule and its preconditions.

    ``select(p, candidates, q, rng, top_s, ranked)`` verifies one node per row. ``laws``: the
    sibling laws the rule is exact for when a node has several children (a single child drawn
    from its q row satisfies every q-based rule). ``shared_q``: reads one q row per sibling group
    (the first sibling's) rather than one per sibling. ``select_mixed(p, candidates, q, copied,
    rng)``: the rule for nodes whose children mix drawn candidates with copied ones after them (the
    ``MIXED`` law); a q-based scheme without it is not exact for such trees.
    """

    name: str
    select: Callable
    summary: str
    needs_q: bool = False
    laws: frozenset[str] = frozenset({COPIED, *SAMPLED_LAWS})
    shared_q: bool = False
    temperature_zero_only: bool = False
    max_width: int | None = None
    select_mixed: Callable | None = None


SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    Scheme("greedy", lambda p, c, q, rng, top_s, ranked: greedy_select(p, c, validate=False),
           "accept the child equal to argmax p (temperature 0 only)", temperature_zero_only=True),
    Scheme("deterministic", lambda p, c, q, rng, top_s, ranked: deterministic_select(p, c, rng, validate=False),
           "draw y ~ p, accept the child equal to y; ignores q, exact for any drafts"),
    Scheme("single", lambda p, c, q, rng, top_s, ranked: single_draft(p, c, q, rng, validate=False),
           "single-draft speculative sampling (one child per node)", needs_q=True, shared_q=True, max_width=1),
    Scheme("specinfer", lambda p, c, q, rng, top_s, ranked: recursive_rejection(p, c, q, rng, validate=False),
           "recursive rejection sampling with replacement (SpecInfer)", needs_q=True,
           laws=frozenset({IID, INDEPENDENT})),
    Scheme("without_replacement",
           lambda p, c, q, rng, top_s, ranked: recursive_rejection(p, c, q, rng, without_replacement=True,
                                                                   validate=False),
           "recursive rejection sampling without replacement (MCSD)", needs_q=True,
           laws=frozenset({WITHOUT_REPLACEMENT, MIXED}), shared_q=True,
           select_mixed=lambda p, c, q, copied, rng: recursive_rejection(p, c, q, rng, without_replacement=True,
                                                                         copied=copied, validate=False)),
    Scheme("spectr", lambda p, c, q, rng, top_s, ranked: spectr_select(p, c, q, rng, validate=False),
           "SpecTr K-SEQ", needs_q=True, laws=frozenset({IID}), shared_q=True),
    Scheme("canonical_lp", lambda p, c, q, rng, top_s, ranked: canonical_select(
        p, c, q, rng, rule="lp", top_s=top_s, ranked=ranked, validate=False),
           "canonical decomposition, selection by linear program", needs_q=True, laws=frozenset({IID}),
           shared_q=True),
    Scheme("canonical_wis", lambda p, c, q, rng, top_s, ranked: canonical_select(
        p, c, q, rng, rule="wis", top_s=top_s, ranked=ranked, validate=False),
           "canonical decomposition, weighted importance sampling selection", needs_q=True,
           laws=frozenset({IID}), shared_q=True),
)}
"""Every scheme by name."""

NAMES = (AUTO, *SCHEMES)
"""What a ``scheme=`` option accepts."""

_AUTO_BY_LAW = {COPIED: "deterministic", IID: "canonical_wis", INDEPENDENT: "specinfer",
                WITHOUT_REPLACEMENT: "without_replacement", MIXED: "without_replacement"}


def resolve(name: str, law: DraftLaw | None, temperature: float | None = None) -> Scheme:
    """The scheme ``name`` stands for with drafts of ``law`` (None: no drafts) at ``temperature``.

    "auto": greedy at temperature 0, otherwise the best exact scheme for the law (deterministic
    for copied drafts, the canonical decomposition for i.i.d. ones)."""
    if name == AUTO:
        if temperature == 0:
            return SCHEMES["greedy"]
        return SCHEMES[_AUTO_BY_LAW[law.law if law is not None else COPIED]]
    if name not in SCHEMES:
        raise ValueError(f"scheme={name!r}: must be one of {', '.join(NAMES)}")
    return SCHEMES[name]


def check_drafts(name: str, law: DraftLaw | None, temperature: float | None = None, drafter: str = "") -> None:
    """Raise ValueError, saying why, unless scheme ``name`` is exact for drafts of ``law`` at
    ``temperature`` (None: check only what does not depend on it). ``drafter`` names the drafts'
    source in the message."""
    scheme = resolve(name, law, temperature)
    source = f"drafter {drafter!r}" if drafter else "the drafter"
    if scheme.temperature_zero_only and temperature is not None and temperature > 0:
        raise ValueError(f"scheme={name!r} is exact only at temperature 0 (it accepts the argmax); at "
                         f"temperature={temperature} it would turn sampling into greedy decoding: use 'auto' or "
                         f"'deterministic'")
    if law is None:
        return
    if scheme.needs_q and not law.sampled:
        raise ValueError(f"scheme={name!r} needs the distribution q each draft was drawn from, but {source} "
                         f"copies its drafts (no q): use 'auto' or 'deterministic' (or sampled drafts from a drafter that samples)")
    if scheme.needs_q and law.law == MIXED and scheme.select_mixed is None:
        raise ValueError(f"scheme={name!r} needs the q of every draft, but {source} verifies copied drafts (no q) "
                         f"beside the drawn ones: use 'auto', 'without_replacement' or 'deterministic'")
    if scheme.max_width is not None and law.width > scheme.max_width:
        raise ValueError(f"scheme={name!r} takes at most {scheme.max_width} child per node, but {source} "
                         f"proposes up to {law.width}: lower max_draft_nodes below twice max_draft_tokens or "
                         f"use a multi-draft scheme")
    if scheme.needs_q and law.width > 1 and law.law not in scheme.laws:
        wanted = " or ".join(_PHRASE[x] for x in sorted(scheme.laws))
        raise ValueError(f"scheme={name!r} is exact only for sibling drafts drawn {wanted}, but {source} draws "
                         f"them {_PHRASE[law.law]} (up to {law.width} per node): use 'auto' or one of "
                         f"{', '.join(s.name for s in SCHEMES.values() if _exact(s, law))}")


def _exact(scheme: Scheme, law: DraftLaw) -> bool:
    """Whether ``scheme`` uses the q of drafts of ``law`` and is exact for them."""
    return (scheme.needs_q and law.law in scheme.laws and (scheme.max_width is None or law.width <= scheme.max_width)
            and (law.law != MIXED or scheme.select_mixed is not None))
