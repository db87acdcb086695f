"""Tree verification: walk every sample's draft tree from its root in one batched call.

At each depth, every sample still walking sits at one node; the chosen token-level scheme runs
once for all of them over that node's children (the candidates), then each sample either descends
into the accepted child or stops with the scheme's output token as its bonus token. The loop is
over depth, never over samples. Lossless by induction over depth: each node's scheme emits exactly
p(. | prefix), and a child's own drafts were drawn given its token, independently of the decision.

Packed layout (matches the engine's forward): sample b owns nodes node_offsets[b]:node_offsets[b+1]
and rows node_offsets[b] + b ... node_offsets[b+1] + b of p: first its root row (the distribution
after its last accepted token), then one row per node (the distribution after that node's token).

Temperature 0: pass scheme="greedy" with any p whose argmax is the greedy token (probabilities or
logits-derived); it never draws random numbers. A batch that mixes greedy and sampled samples
passes one-hot rows for the greedy ones: every scheme then follows argmax exactly, since each is
lossless for every p.

Randomness: a ``torch.Generator`` (draws in call order), or :class:`~multispec.verify.sampling.PositionKeys`
(the engine): sample b's draws at depth d are keyed by its key and output position start[b] + d,
so they never depend on the rest of the batch or on what was drafted.
"""

from dataclasses import dataclass

import numpy as np
import torch

from multispec.verify import sampling
from multispec.verify.batch import Selection, normalise
from multispec.verify.canonical import DEFAULT_RANKED, DEFAULT_TOP_S
from multispec.verify.recursive import check_copied_after_drawn
from multispec.verify.sampling import PositionKeys, Uniforms, derive, keyed_uniforms
from multispec.verify.schemes import SCHEMES, Scheme, resolve
from multispec.verify.support import SupportQ, dense_rows, entries
from multispec.verify.validation import check_distribution, check_integer


@dataclass
class TreeVerifyResult:
    """Per sample: the accepted path (root child first) and the bonus token drawn where the walk stopped."""

    accepted_nodes: list[list[int]]  # local node indices along the accepted path
    num_accepted: torch.Tensor  # [B] long
    bonus_token: torch.Tensor  # [B] long
    accepted_path: torch.Tensor  # [B, depth_max] long local node indices, -1 fill (depth_max = deepest tree)
    accepted_tokens: torch.Tensor  # [B, depth_max] long tokens of the accepted nodes, -1 fill


@dataclass
class TreeLayout:
    """Index tensors derived once from the packed tree description."""

    root_row: torch.Tensor  # [B] row of p holding each sample's root distribution
    node_row: torch.Tensor  # [M] row of p holding the distribution after each node
    first_node: torch.Tensor  # [B] global index of each sample's first node
    children: torch.Tensor  # [B + M, max(1, K_max)] global node ids of each row's children, -1 padded
    depth_max: int


def verify_tree(
    p: torch.Tensor,
    node_tokens: torch.Tensor,
    node_parents: torch.Tensor,
    node_offsets: torch.Tensor,
    q: "torch.Tensor | SupportQ | None" = None,
    scheme: str = "auto",
    rng: PositionKeys | torch.Generator | None = None,
    *,
    validate: bool = True,
    top_s: int = DEFAULT_TOP_S,
    ranked: int | None = DEFAULT_RANKED,
    q_index: torch.Tensor | None = None,
    layout: "TreeLayout | None" = None,
    p_argmax: torch.Tensor | None = None,
) -> TreeVerifyResult:
    """Accepted path and bonus token for every sample of a packed batch of draft trees.

    p [B + M, V] target probabilities (temperature/top-k/top-p already applied); node_tokens [M],
    node_parents [M] (local parent index, -1 = root child, parents before children), node_offsets
    [B + 1]; q [M, V] the distribution each node was drawn from (dense, or a ``SupportQ``: rows kept
    over the drafter's vocabulary), or None for deterministic drafts.

    Trees that mix drawn nodes with copied ones (the ``MIXED`` law): ``q_index`` [M] gives each
    node's row of q ([R, V], one row per drawn node), -1 for a copied node. Among the children of
    a node the copied ones must follow the drawn ones; the scheme's ``select_mixed`` verifies them.

    Which joint law the siblings were drawn from decides which schemes are lossless (see
    ``multispec.verify.schemes``: each scheme's preconditions, checked by the engine before a
    request runs). "auto" picks "deterministic" when q is None, "without_replacement" for mixed
    trees (``q_index``) and "canonical_wis" otherwise (i.i.d. siblings).

    ``layout``: the trees' ``TreeLayout`` where the caller has it (``layout_of_trees`` builds it
    from the parent lists without a pass of tensor operations); else derived from the tensors.
    ``p_argmax`` [B + M]: each row's argmax where the caller has it (the engine's softmax gives it
    for greedy rows); the greedy scheme then reads no row of p.
    """
    if scheme == "auto":
        chosen = SCHEMES["without_replacement" if q_index is not None else "deterministic" if q is None
                         else "canonical_wis"]
    else:
        chosen = resolve(scheme, None)
    if validate:
        _check_tree(p, node_tokens, node_parents, node_offsets, q, chosen, q_index)
    if layout is None:
        layout = tree_layout(node_parents, node_offsets)
    if validate and q_index is not None:
        _check_copied_after_drawn(layout, q_index)
    if chosen.max_width is not None and layout.children.shape[1] > chosen.max_width:
        raise ValueError(f"scheme {chosen.name!r} takes at most {chosen.max_width} child per node; use a multi-draft "
                         f"scheme for branching trees")
    if chosen.name in DIRECT:
        return _walk_direct(p, node_tokens, layout, rng, greedy=chosen.temperature_zero_only,
                            argmax=p_argmax if chosen.temperature_zero_only else None)
    if chosen.name in CHAINED and isinstance(rng, PositionKeys):
        if q is not None and q_index is None and layout.children.shape[1] == 1:
            return _walk_chains(p, node_tokens, layout, q, rng)
        if q_index is not None and chosen.select_mixed is not None:
            walked = _walk_chains(p, node_tokens, layout, q, rng, q_index)
            if walked is not None:
                return walked
    return _walk(chosen, p, node_tokens, layout, q, rng, top_s, ranked, q_index)


DIRECT = ("greedy", "deterministic")
"""Schemes whose output at a node is a draw from p (or its argmax) looked up among the children:
walked by ``_walk_direct``."""


def _walk_direct(p: torch.Tensor, node_tokens: torch.Tensor, layout: TreeLayout, rng, greedy: bool,
                 argmax: torch.Tensor | None = None) -> TreeVerifyResult:
    """The tree walk of the greedy and deterministic schemes, the trees in Python lists: at each
    depth one draw for every walking sample (argmax at temperature 0), with the same random numbers
    as ``_walk`` takes (the sample's position keys at that depth, or the generator's next draws), then
    the first child holding the drawn token, if any. Exactly ``_walk``'s result with a handful of
    tensor operations a depth instead of some forty (the engine's default drafts are copied); with
    position keys and a small forest, every row drawn in one call first (``ALL_ROWS_AT_ONCE``)."""
    tokens, children, node_row = node_tokens.tolist(), layout.children.tolist(), layout.node_row.tolist()
    current, first = layout.root_row.tolist(), layout.first_node.tolist()
    batch, device = len(current), p.device
    path: list[list[int]] = [[] for _ in range(batch)]
    bonus = [-1] * batch
    walking, depth = list(range(batch)), 0
    tops = argmax.tolist() if argmax is not None else None
    if tops is None and not greedy and isinstance(rng, PositionKeys) and len(tokens) <= ALL_ROWS_AT_ONCE:
        tops = _draw_every_row(p, row_keys(p.shape[0], layout, rng, children))
    if tops is not None:  # greedy with the rows' argmax given, or every row drawn already
        path, bonus, _ = walk_drawn(tokens, layout, children, tops)
        return _listed_result(path, bonus, tokens, first, layout.depth_max, device)
    while walking:
        rows = [current[b] for b in walking]
        every = depth == 0 and len(rows) == p.shape[0]
        p_rows = p if every else p[torch.tensor(rows, device=device)]
        if greedy:
            drawn = p_rows.argmax(-1).tolist()
        else:
            who = torch.tensor(walking)
            uniforms = rng.at(who, depth) if isinstance(rng, PositionKeys) else Uniforms(len(walking), generator=rng)
            drawn = sampling.sample_rows(p_rows, uniforms, fallback=p_rows).tolist()
        still = []
        for b, row, y in zip(walking, rows, drawn):
            child = next((c for c in children[row] if c >= 0 and tokens[c] == y), -1)
            if child < 0:
                bonus[b] = y
            else:
                path[b].append(child)
                current[b] = node_row[child]
                still.append(b)
        walking, depth = still, depth + 1
    return _listed_result(path, bonus, tokens, first, layout.depth_max, device)


ALL_ROWS_AT_ONCE = 24
"""Forests of up to this many nodes in all have every row of p drawn in one call before the walk
(``row_keys``) instead of the rows the walk reaches depth by depth. A depth's call costs about
150 us here (its keys, a gather of its rows, the call), a row's draw 5-10 us (one pass over 49k
probabilities): a step of one request of 4 samples walks 2-3 depths over a dozen nodes, so one
call wins. The bound keeps the rows drawn and never reached (at most this many) within one call's
cost where a large batch walks few depths."""


def walk_drawn(tokens: list[int], layout: TreeLayout, children: list[list[int]],
               drawn: list[int]) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """The deterministic walk where every row's token is drawn already (``drawn[row]``): each
    sample descends into the first child holding its row's token and stops with the token as its
    bonus where none does. Returns each sample's accepted nodes (global ids), its bonus token and
    the rows it visited (its root's, then each accepted node's)."""
    node_row = layout.node_row.tolist()
    paths, bonus, visited = [], [], []
    for row in layout.root_row.tolist():
        path, rows = [], [row]
        while True:
            y = drawn[row]
            child = next((c for c in children[row] if c >= 0 and tokens[c] == y), -1)
            if child < 0:
                break
            path.append(child)
            row = node_row[child]
            rows.append(row)
        paths.append(path)
        bonus.append(y)
        visited.append(rows)
    return paths, bonus, visited


def row_keys(rows: int, layout: TreeLayout, rng: PositionKeys, children: list[list[int]]) -> np.ndarray:
    """Each row's key as the walks key it (``PositionKeys.at``): sample b's root row at its start,
    the row after one of its nodes at depth d at start + d. [rows] uint64."""
    node_row = layout.node_row.tolist()
    row_sample = [0] * rows
    row_depth = [0] * rows
    frontier = layout.root_row.tolist()
    for b, row in enumerate(frontier):
        row_sample[row] = b
    while frontier:
        grown = []
        for row in frontier:
            for kid in children[row]:
                if kid >= 0:
                    below = node_row[kid]
                    row_sample[below], row_depth[below] = row_sample[row], row_depth[row] + 1
                    grown.append(below)
        frontier = grown
    samples = np.asarray(row_sample, dtype=np.int64)
    return derive(rng.sample_keys[samples], rng.start[samples] + np.asarray(row_depth, dtype=np.int64))


def _draw_every_row(p: torch.Tensor, keys: np.ndarray) -> list[int]:
    """The token each row of p draws, keyed as the walk keys it (``row_keys``). Every row's own
    draw, in one ``sample_rows`` call: the rows the walk reaches take exactly the tokens a draw per
    depth gives them (each row is drawn alone, from its own uniform)."""
    return sampling.sample_rows(p, Uniforms(p.shape[0], keys=keys), fallback=p).tolist()


def _listed_result(path: list[list[int]], bonus: list[int], tokens: list[int], first: list[int], width: int,
                   device) -> TreeVerifyResult:
    """A list walk's result: each sample's accepted nodes (global ids) and bonus token."""
    batch = len(path)
    local = [[c - first[b] for c in nodes] for b, nodes in enumerate(path)]
    padded = torch.tensor([row + [-1] * (width - len(row)) for row in local], dtype=torch.long,
                          device=device).reshape(batch, width)
    path_tokens = torch.tensor([[tokens[c] for c in nodes] + [-1] * (width - len(nodes)) for nodes in path],
                               dtype=torch.long, device=device).reshape(batch, width)
    return TreeVerifyResult(local, torch.tensor([len(nodes) for nodes in path], dtype=torch.long, device=device),
                            torch.tensor(bonus, dtype=torch.long, device=device), padded, path_tokens)


CHAINED = ("without_replacement", "specinfer")
"""Schemes that verify a node's only child by recursive rejection: a chain of drawn nodes (each
node one child at most, every node with its q) is walked by ``_walk_chains``."""


def _walk_chains(p: torch.Tensor, node_tokens: torch.Tensor, layout: TreeLayout, q: torch.Tensor | None,
                 rng: PositionKeys, q_index: torch.Tensor | None = None) -> TreeVerifyResult | None:
    """The walk of recursive rejection over chains of drawn nodes (the draft head's candidates one
    wide), the trees in Python lists: at each depth, every walking sample's drawn child x is
    accepted with probability min(1, p(x) / q(x)), else the sample's next token is drawn from
    norm((p - q)+); a sample at a leaf draws from p. The same tensors and the same keyed random
    numbers as ``_walk`` with ``recursive_rejection``, so the same result (a test checks it field
    for field), with a few tensor operations a step instead of some seventy a depth.

    Every row's numbers are keyed by its sample and depth alone, so the work is not done depth by
    depth: the accept test of every drawn child in one set of tensor operations, and (for forests
    of up to ``ALL_ROWS_AT_ONCE`` nodes) every row's draw from p in one call. Then each sample
    walks its accepted children in lists to the row where it stops; the residual draws of the rows
    where a drawn child was rejected are made together, one call a round (a round more only where
    such a draw lands on a copied child and the walk goes on).

    With ``q_index`` (the drawn hybrid's trees: each node's q row, -1 for copied text) a node may
    also have copied children after its drawn one: the token drawn where the drawn child was
    rejected (or from p where the node has no drawn child) is looked up among them, the
    deterministic rule on the residual, as ``recursive_rejection`` verifies copied candidates.
    None where some node has more than one drawn child (``_walk`` verifies those trees)."""
    tokens, node_row = node_tokens.tolist(), layout.node_row.tolist()
    first = layout.first_node.tolist()
    children = layout.children.tolist()
    if q_index is None:
        drawn_kid = [kids[0] for kids in children]
        copied_kids: list[list[int]] = [[] for _ in drawn_kid]
        q_row = list(range(len(tokens)))
    else:
        q_row = q_index.tolist()
        drawn_kid, copied_kids = [], []
        for kids in children:
            drawn = [c for c in kids if c >= 0 and q_row[c] >= 0]
            if len(drawn) > 1:
                return None
            drawn_kid.append(drawn[0] if drawn else -1)
            copied_kids.append([c for c in kids if c >= 0 and q_row[c] < 0])
    device = p.device
    keys = row_keys(p.shape[0], layout, rng, children)
    # The accept test of every drawn child: u * q(x) < p(x) at its parent's row.
    accepted = [False] * p.shape[0]
    tested = [row for row, kid in enumerate(drawn_kid) if kid >= 0]
    if tested:
        kids = [drawn_kid[row] for row in tested]
        row_t = torch.tensor(tested, device=device)
        token_t = torch.tensor([tokens[kid] for kid in kids], device=device)
        u = keyed_uniforms(derive(keys[tested], sampling.TEST, 0), p.dtype).to(device)
        q_of = entries(q, torch.tensor([q_row[kid] for kid in kids], device=device), token_t)
        for row, ok in zip(tested, (u * q_of < p[row_t, token_t]).tolist()):
            accepted[row] = ok
    from_p = None
    if len(tokens) <= ALL_ROWS_AT_ONCE:
        from_p = _draw_every_row(p, keys)
    current = layout.root_row.tolist()
    batch = len(current)
    path: list[list[int]] = [[] for _ in range(batch)]
    bonus = [-1] * batch
    walking = list(range(batch))
    while walking:
        leaves, rejected = [], []  # (sample, row) where it draws from p, or from the residual
        for b in walking:
            row = current[b]
            while drawn_kid[row] >= 0 and accepted[row]:
                path[b].append(drawn_kid[row])
                row = node_row[drawn_kid[row]]
            current[b] = row
            (leaves if drawn_kid[row] < 0 else rejected).append((b, row))
        drawn_at: list[tuple[int, int, int]] = []  # (sample, row, token drawn there)
        if leaves:
            rows = [row for _, row in leaves]
            if from_p is not None:
                drawn = [from_p[row] for row in rows]
            else:
                p_rows = p[torch.tensor(rows, device=device)]
                drawn = sampling.sample_rows(p_rows, Uniforms(len(rows), keys=keys[rows]), fallback=p_rows).tolist()
            drawn_at += [(b, row, y) for (b, row), y in zip(leaves, drawn)]
        if rejected:
            rows = [row for _, row in rejected]
            row_t = torch.tensor(rows, device=device)
            p_rej = p[row_t]
            q_rej = dense_rows(q, torch.tensor([q_row[drawn_kid[row]] for row in rows], device=device))
            residual = normalise((p_rej - q_rej).clamp_min(0), p_rej)
            drawn = sampling.sample_rows(residual, Uniforms(len(rows), keys=keys[rows]), fallback=residual).tolist()
            drawn_at += [(b, row, y) for (b, row), y in zip(rejected, drawn)]
        still = []
        for b, row, y in drawn_at:
            kid = next((c for c in copied_kids[row] if tokens[c] == y), -1)
            if kid < 0:
                bonus[b] = y
            else:
                path[b].append(kid)
                current[b] = node_row[kid]
                still.append(b)
        walking = sorted(still)
    return _listed_result(path, bonus, tokens, first, layout.depth_max, device)


def _walk(chosen: Scheme, p, node_tokens, layout: TreeLayout, q, rng, top_s, ranked, q_index) -> TreeVerifyResult:
    """The tree walk of any scheme, with tensor operations over the walking samples at each depth."""
    batch = layout.root_row.shape[0]
    device = p.device
    current = layout.root_row.clone()
    walking = torch.ones(batch, dtype=torch.bool, device=device)
    path = torch.full((batch, layout.depth_max), -1, dtype=torch.long, device=device)
    bonus = torch.full((batch,), -1, dtype=torch.long, device=device)
    for depth in range(layout.depth_max + 1):
        who = walking.nonzero().squeeze(1)
        if who.numel() == 0:
            break
        rows = current[who]
        kids = layout.children[rows]
        kids = kids[:, : max(1, int((kids >= 0).sum(1).max()))]
        if chosen.temperature_zero_only:  # greedy draws nothing
            uniforms = None
        elif isinstance(rng, PositionKeys):
            uniforms = rng.at(who, depth)
        else:
            uniforms = Uniforms(who.numel(), generator=rng)
        # A step without drafts visits every row of p once, in order, at depth 0: no copy of p.
        every = depth == 0 and rows.numel() == p.shape[0]
        choice = _select_at_nodes(chosen, _Rows(p, None if every else rows), kids, node_tokens, q, uniforms, top_s,
                                  ranked, q_index)
        accepted = choice.index >= 0
        child = kids.gather(1, choice.index.clamp_min(0)[:, None]).squeeze(1)
        stopped = who[~accepted]
        bonus[stopped] = choice.token[~accepted]
        walking[stopped] = False
        if bool(accepted.any()):
            went = who[accepted]
            path[went, depth] = child[accepted]
            current[went] = layout.node_row[child[accepted]]
    return _result(path, bonus, node_tokens, layout)


class _Rows:
    """Rows ``index`` of p (None: all of p, in order), copied out only for the rows a scheme reads:
    each row is a vocabulary wide, and a node's rows split into leaves and inner nodes."""

    def __init__(self, p: torch.Tensor, index: torch.Tensor | None):
        self.p, self.index = p, index
        self.n = p.shape[0] if index is None else index.numel()

    def all(self) -> torch.Tensor:
        return self.p if self.index is None else self.p[self.index]

    def some(self, which: torch.Tensor) -> torch.Tensor:
        return self.p[which if self.index is None else self.index[which]]


def _select_at_nodes(scheme: Scheme, p_rows: _Rows, kids, node_tokens, q, rng: Uniforms | None, top_s, ranked,
                     q_index=None) -> Selection:
    """Run the scheme at one node per row; rows without children take argmax p (greedy) or a draw
    from p, the same draw plain sampling makes there. With ``q_index`` (trees mixing drawn and
    copied nodes), the scheme's ``select_mixed`` verifies each row's drawn children, then its copied
    ones."""
    n, device = p_rows.n, p_rows.p.device
    no_index = torch.full((n,), -1, dtype=torch.long, device=device)
    greedy = scheme.temperature_zero_only
    if not bool((kids[:, 0] >= 0).any()):
        every = p_rows.all()
        token = every.argmax(-1) if greedy else sampling.sample_rows(every, rng, fallback=every)
        return Selection(token, no_index)
    candidates = torch.where(kids >= 0, node_tokens[kids.clamp_min(0)], -1)
    if not scheme.needs_q:  # greedy and deterministic take leaves as nodes without candidates
        return scheme.select(p_rows.all(), candidates, None, rng, top_s, ranked)
    leaf = kids[:, 0] < 0
    token = torch.empty(n, dtype=torch.long, device=device)
    if bool(leaf.any()):
        rows = leaf.nonzero().squeeze(1)
        p_leaf = p_rows.some(rows)
        token[rows] = sampling.sample_rows(p_leaf, rng.rows(rows), fallback=p_leaf)
    inner = (~leaf).nonzero().squeeze(1)
    if inner.numel() and q_index is not None:
        inner_kids = kids[inner]
        rows_of_q = torch.where(inner_kids >= 0, q_index[inner_kids.clamp_min(0)], -1)
        copied = (inner_kids >= 0) & (rows_of_q < 0)
        p_inner = p_rows.some(inner)
        # A row whose first child is copied has only copied ones: its q row is never read.
        q_rows = dense_rows(q, rows_of_q[:, 0].clamp_min(0)) if q is not None else p_inner
        chosen = scheme.select_mixed(p_inner, candidates[inner], q_rows, copied, rng.rows(inner))
        token[inner] = chosen.token
        no_index[inner] = chosen.index
    elif inner.numel():
        inner_kids = kids[inner]
        q_rows = dense_rows(q, inner_kids[:, 0] if scheme.shared_q else inner_kids.clamp_min(0))
        chosen = scheme.select(p_rows.some(inner), candidates[inner], q_rows, rng.rows(inner), top_s, ranked)
        token[inner] = chosen.token
        no_index[inner] = chosen.index
    return Selection(token, no_index)


def tree_layout(node_parents: torch.Tensor, node_offsets: torch.Tensor) -> TreeLayout:
    """Rows, children lists and depth of the packed trees, with tensor ops only (no loop over nodes)."""
    device = node_parents.device
    batch = node_offsets.shape[0] - 1
    num_nodes = node_parents.shape[0]
    counts = node_offsets.diff()
    sample = torch.repeat_interleave(torch.arange(batch, device=device), counts)
    node = torch.arange(num_nodes, device=device)
    root_row = node_offsets[:-1] + torch.arange(batch, device=device)
    node_row = node + sample + 1
    first_node = node_offsets[:-1]
    parent_node = torch.where(node_parents >= 0, first_node[sample] + node_parents, -1)
    parent_row = torch.where(node_parents >= 0, node_row[parent_node.clamp_min(0)], root_row[sample])
    per_row = torch.bincount(parent_row, minlength=batch + num_nodes)
    width = max(1, int(per_row.max()) if num_nodes else 0)
    order = torch.argsort(parent_row, stable=True)
    slot = torch.arange(num_nodes, device=device) - (per_row.cumsum(0) - per_row)[parent_row[order]]
    children = torch.full((batch + num_nodes, width), -1, dtype=torch.long, device=device)
    children[parent_row[order], slot] = order
    return TreeLayout(root_row, node_row, first_node, children, _depth_max(parent_node))


def layout_of_trees(parents: list[list[int]], device: torch.device | str = "cpu") -> TreeLayout:
    """``tree_layout`` of the packed trees whose local parent lists are ``parents`` (one list per
    sample), built in Python: for the few small trees of a decode step this is a handful of list
    operations and five tensors, where the tensor version runs some thirty small operations."""
    batch, num_nodes = len(parents), sum(len(ps) for ps in parents)
    root_row, node_row, first_node = [], [], []
    rows_children: list[list[int]] = [[] for _ in range(batch + num_nodes)]
    depth_max, node = 0, 0
    for b, ps in enumerate(parents):
        root = node + b
        root_row.append(root)
        first_node.append(node)
        depth: list[int] = []
        for j, parent in enumerate(ps):
            node_row.append(node + j + b + 1)
            rows_children[root if parent < 0 else node + parent + b + 1].append(node + j)
            depth.append(1 if parent < 0 else depth[parent] + 1)
        depth_max = max(depth_max, max(depth, default=0))
        node += len(ps)
    width = max(1, max(len(kids) for kids in rows_children))
    children = [kids + [-1] * (width - len(kids)) for kids in rows_children]

    def longs(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return TreeLayout(longs(root_row), longs(node_row), longs(first_node), longs(children).reshape(-1, width),
                      depth_max)


def _depth_max(parent_node: torch.Tensor) -> int:
    """Depth of the deepest node (root children have depth 1) by pointer jumping: O(log M) passes."""
    if parent_node.numel() == 0:
        return 0
    hop = parent_node.clone()
    depth = torch.ones_like(parent_node)
    for _ in range(max(1, parent_node.numel().bit_length())):
        up = hop >= 0
        depth = torch.where(up, depth + depth[hop.clamp_min(0)], depth)
        hop = torch.where(up, hop[hop.clamp_min(0)], hop)
    return int(depth.max())


def _result(path, bonus, node_tokens, layout) -> TreeVerifyResult:
    """Local indices, tokens and counts of the accepted paths."""
    taken = path >= 0
    local = torch.where(taken, path - layout.first_node[:, None], -1)
    tokens = torch.where(taken, node_tokens[path.clamp_min(0)], -1)
    num = taken.sum(1)
    nodes = [row[:k] for row, k in zip(local.tolist(), num.tolist())]
    return TreeVerifyResult(nodes, num, bonus, local, tokens)


def _check_copied_after_drawn(layout: TreeLayout, q_index: torch.Tensor) -> None:
    kids = layout.children
    if q_index.numel() == 0:  # no nodes at all: nothing to order
        return
    check_copied_after_drawn(kids, (kids >= 0) & (q_index[kids.clamp_min(0)] < 0))


def _check_tree(p, node_tokens, node_parents, node_offsets, q, scheme, q_index=None) -> None:
    """Raise ValueError naming the first problem with the packed inputs."""
    check_integer("node_tokens", node_tokens, 1)
    check_integer("node_parents", node_parents, 1)
    check_integer("node_offsets", node_offsets, 1)
    if p.dim() != 2:
        raise ValueError(f"p must be [B + M, V], got shape {tuple(p.shape)}")
    num_nodes, batch = node_tokens.shape[0], node_offsets.shape[0] - 1
    if batch < 1:
        raise ValueError("node_offsets must hold B + 1 >= 2 entries")
    if node_parents.shape[0] != num_nodes:
        raise ValueError(f"node_parents has {node_parents.shape[0]} entries but node_tokens has {num_nodes}")
    if int(node_offsets[0]) != 0 or int(node_offsets[-1]) != num_nodes or bool((node_offsets.diff() < 0).any()):
        raise ValueError(f"node_offsets must rise from 0 to M = {num_nodes}")
    if p.shape[0] != batch + num_nodes:
        raise ValueError(f"p has {p.shape[0]} rows; expected B + M = {batch} + {num_nodes}")
    check_distribution("p", p)
    vocab = p.shape[1]
    if bool(((node_tokens < 0) | (node_tokens >= vocab)).any()):
        raise ValueError(f"node_tokens: token ids must lie in [0, {vocab})")
    sample = torch.repeat_interleave(torch.arange(batch, device=p.device), node_offsets.diff())
    local = torch.arange(num_nodes, device=p.device) - node_offsets[:-1][sample]
    if bool(((node_parents < -1) | (node_parents >= local)).any()):
        raise ValueError("node_parents: each parent must be -1 (root) or an earlier node of the same sample")
    if q_index is not None:
        check_integer("q_index", q_index, 1)
        if scheme.needs_q and scheme.select_mixed is None:
            raise ValueError(f"scheme {scheme.name!r} cannot verify copied nodes (q_index -1) beside drawn ones")
        rows = 0 if q is None else q.shape[0]
        if q_index.shape[0] != num_nodes or bool(((q_index < -1) | (q_index >= rows)).any()):
            raise ValueError(f"q_index must give each of the {num_nodes} nodes a row of q (< {rows}) or -1")
        if q is not None:
            if len(q.shape) != 2 or q.shape[1] != vocab:
                raise ValueError(f"q must be [R, V] with V = {vocab}, got shape {tuple(q.shape)}")
            _check_q(q)
    elif scheme.needs_q:
        if q is None:
            raise ValueError(f"scheme {scheme.name!r} needs q, the draft distributions of the nodes")
        if tuple(q.shape) != (num_nodes, vocab):
            raise ValueError(f"q must be [M, V] = [{num_nodes}, {vocab}], got shape {tuple(q.shape)}")
        _check_q(q)


def _check_q(q) -> None:
    if not isinstance(q, SupportQ):
        check_distribution("q", q)
        return
    check_integer("q.support", q.support, 1)
    if q.support.numel() and bool(((q.support < 0) | (q.support >= q.vocab_size)).any()):
        raise ValueError(f"q.support: token ids must lie in [0, {q.vocab_size})")
    if q.support.unique().numel() != q.support.numel():
        raise ValueError("q.support: token ids must be distinct")
    check_distribution("q", q.values)
