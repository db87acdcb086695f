"""What a decode step costs on this machine for this model: the prices the draft budget weighs
drafts against, measured once and cached.

A step of B samples carrying T tokens in all costs

    seconds = base(T) + per_work * W + (extra(B) if any sample drafted)

with W the step's attention work (query rows times keys, ``DraftBudget.work``). ``base`` is a
measured curve, not a line: on a CPU a forward of 4 tokens costs nearly what one of 16 does (the
step is bound by overhead and by reading the weights), while from about a hundred rows every row
adds its matrix products; on a GPU the flat part reaches much further. ``extra`` is what drafting
at all adds to a step (the second attention part, tree verification, cache moves). A running fit
over the steps a workload happens to run sees few shapes, mostly one, and extrapolates the rest
with the noise of a shared machine in it; here every term comes from steps of the engine's own
decode path at chosen shapes, the cheapest of three passes over them (see ``measure``).

``measure`` runs those steps through a scratch engine that shares the model's weights (its own
small KV cache, synthetic prompts, a drafter that drafts fixed-length chains): about 20 seconds
for the default model on a 2-core CPU. ``load_or_measure`` keeps the result in the cache
directory, keyed by the machine (CPU or GPU model, threads), the model file, the dtype and the
versions of torch and multispec, so it is measured once per machine and model; prices measured
while other work kept the machine busy are used but not cached (see ``BUSY``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
from bisect import bisect_right
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from multispec.engine.attention import compiled_kernel, split_step
from multispec.models.llama import AFFINE_ROWS

if TYPE_CHECKING:
    from multispec.engine.engine import LLMEngine

log = logging.getLogger("multispec")

FORMAT = 9
"""Version of the measurement and its file; a change re-measures (2: steps got cheaper with
prepacked weights, so prices measured before are stale; 3: the compiled CPU attention; 4: the
compiled layer stack; 5: draft rows' attention on AMX tiles; 6: every prompt half on AMX tiles,
sixteen rows of a prompt's samples at a time; 7: a point at 17 samples, see ``PLAIN_BATCHES``;
8: a point at ``AFFINE_ROWS`` + 1; 9: the file records how long the measurement waited for a
core, and one that waited long is not cached, see ``BUSY``: tables cached before may have been
measured on a busy machine)."""
BUSY = 0.1
"""A measurement whose threads waited for a core more than this share of the time they ran is not
cached. Taking each shape's cheapest pass rids the prices of bursts, not of a machine that stays
busy: with one other process spinning on a 2-core Zen 4 the threads waited 0.56 s a second of
running, a plain step of 16 samples was priced 37.9 ms against 17.4 on the quiet machine and 32
tokens 94 against 28 ms, and cached once, such a table made the draft budget draft almost nothing
on every later run. Quiet, the same measurement waited 0.005 s a second of running."""
WORK_UNIT = 1e4
"""Scale of the attention-work feature (query rows x keys)."""
PLAIN_BATCHES = tuple(sorted({1, 2, 4, 8, 16, 17, 32, 64, 128, AFFINE_ROWS + 1}))
"""Samples per measured plain step: the base curve's points. 17 because products of a few rows on
AMX tiles take their rows sixteen at a time (``multispec/kernels/stream_gemm.cpp``): a 17th row
costs a second pass of tile products, about 40% more on a step of 16 samples on a 2-core Xeon,
which a line from 16 to 32 would spread over the next sixteen rows and so price a first draft
token of a 16-sample step far too low. ``AFFINE_ROWS`` + 1 (11) for the same reason in float32 on
AVX2: products of up to ``AFFINE_ROWS`` rows read a GGUF model's weights as integer blocks, the
next row all of the float32 weights (a plain step of 8 samples took 25.4 ms with the blocks and
31.2 without on a 2-core Zen 2)."""
DRAFT_BATCHES = (1, 4, 16, 64)
"""Samples per measured drafting step (each drafts ``DRAFT_LENGTHS`` tokens in turn): the points of
``extra``, and the base curve past the largest plain step."""
DRAFT_LENGTHS = (1, 3)
CONTEXT_BATCHES = (8, 32)
"""Samples per plain step measured at a short and a long context: the price of attention work."""
SHORT_PROMPT, LONG_PROMPT = 32, 512
ROUNDS = 3
"""Passes over every shape; a shape's price is its cheapest pass (see ``measure``)."""
REPEATS = 2
"""Timed steps per shape and pass (their median is the pass's)."""
WARM_STEPS = 1


def work(batch: int, qmax: int, context: int, drafting: int | None = None, tokens: int | None = None) -> float:
    """Attention work of a step: query rows as ``DecodeAttention`` lays them out, times the
    context. Its rows are every sample's ``qmax`` rows, or, where it splits the step (see
    ``split_step``), the root rows plus the drafting samples' draft rows padded to the deepest
    draft. ``tokens``: the step's token count (default: every drafting sample at full depth)."""
    if drafting is None:
        drafting = batch if qmax > 1 else 0
    if tokens is None:
        tokens = batch + drafting * (qmax - 1)
    rows = batch + drafting * (qmax - 1) if split_step(batch, qmax, drafting, tokens) else batch * qmax
    return rows * context / WORK_UNIT


@dataclass(frozen=True)
class Measurement:
    """One timed step shape: samples, tokens in the forward, attention work, whether any sample
    drafted, median seconds."""

    batch: int
    tokens: int
    work: float
    drafting: bool
    seconds: float


@dataclass
class StepCosts:
    """Measured prices of a decode step (see the module docstring): ``base`` at each of
    ``base_tokens``, ``extra`` at each of ``extra_batches``, and ``per_work``."""

    base_tokens: list[int]
    base: list[float]
    per_work: float
    extra_batches: list[int]
    extra: list[float]
    waited: float | None = None
    """Seconds the measurement's threads waited for a core per second they ran (``core_wait``);
    None where the system does not say."""

    def seconds(self, tokens: int, batch: int, qmax: int, context: int, drafting: int | None = None) -> float:
        """Expected seconds of a step of ``batch`` samples and ``tokens`` tokens whose deepest
        sample has ``qmax`` rows (1: no drafts), ``drafting`` samples of them drafting."""
        spent = self.base_at(tokens) + self.per_work * work(batch, qmax, context, drafting, tokens)
        if qmax > 1:
            spent += _interp(batch, self.extra_batches, self.extra)
        return spent

    def pricer(self, batch: int, context: int) -> Callable[..., float]:
        """``seconds`` of steps of ``batch`` samples at ``context`` as a function of (tokens, qmax,
        drafting): the same values, with what depends on the batch alone worked out once (the
        budget prices every cut of a step's ranked nodes, about 80 with 16 samples drafting)."""
        extra = _interp(batch, self.extra_batches, self.extra)
        base_at, per_work = self.base_at, self.per_work

        def price(tokens: int, qmax: int, drafting: int | None = None) -> float:
            spent = base_at(tokens) + per_work * work(batch, qmax, context, drafting, tokens)
            if qmax > 1:
                spent += extra
            return spent

        return price

    def base_at(self, tokens: int) -> float:
        """The base curve, linear between measured points and past the last one (where every
        row costs its matrix products)."""
        xs, ys = self.base_tokens, self.base
        if tokens <= xs[-1] or len(xs) == 1:
            return _interp(tokens, xs, ys)
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
        return ys[-1] + slope * (tokens - xs[-1])

    @classmethod
    def fit(cls, measurements: list[Measurement]) -> "StepCosts":
        """Prices from timed shapes. ``per_work`` from plain steps of equal size at different
        contexts; ``base`` from every plain step with its attention work taken off, then from the
        drafting steps past the largest plain one (their extra is the extra of the largest
        batch measured both ways); ``extra`` per batch size, what drafting steps cost beyond the
        base and the attention. Both curves are made non-decreasing (more tokens, or more
        samples, never cost less: a dip is noise)."""
        plain = [m for m in measurements if not m.drafting]
        drafting = [m for m in measurements if m.drafting]
        if not plain:
            raise ValueError("no plain step was measured")
        slopes = []
        by_batch: dict[int, list[Measurement]] = {}
        for m in plain:
            by_batch.setdefault(m.batch, []).append(m)
        for group in by_batch.values():
            low, high = min(group, key=lambda m: m.work), max(group, key=lambda m: m.work)
            if high.work > low.work * 2:
                slopes.append((high.seconds - low.seconds) / (high.work - low.work))
        per_work = max(statistics.median(slopes), 0.0) if slopes else 0.0
        base = _monotone(_medians((m.tokens, m.seconds - per_work * m.work) for m in plain))
        costs = cls([t for t, _ in base], [s for _, s in base], per_work, [1], [0.0])
        # The extra of drafting, per batch size, from steps within the plain curve's reach.
        within = [m for m in drafting if m.tokens <= costs.base_tokens[-1]]
        extra = _monotone(_medians((m.batch, m.seconds - costs.base_at(m.tokens) - per_work * m.work)
                                   for m in within), floor=0.0)
        if extra:
            costs.extra_batches, costs.extra = [b for b, _ in extra], [s for _, s in extra]
        # Past the largest plain step, drafting steps carry the base curve on.
        beyond = _medians((m.tokens, m.seconds - per_work * m.work - _interp(m.batch, costs.extra_batches, costs.extra))
                          for m in drafting if m.tokens > costs.base_tokens[-1])
        if beyond:
            points = _monotone(list(zip(costs.base_tokens, costs.base)) + beyond)
            costs.base_tokens, costs.base = [t for t, _ in points], [s for _, s in points]
        return costs

    def table(self) -> str:
        """The prices, for people: base per token count, extra per batch size, per-work price."""
        base = ", ".join(f"{t}: {1e3 * s:.1f}" for t, s in zip(self.base_tokens, self.base))
        extra = ", ".join(f"{b}: {1e3 * s:.1f}" for b, s in zip(self.extra_batches, self.extra))
        waited = "" if self.waited is None else f"; waited for a core {100 * self.waited:.1f}% of the time it ran"
        return (f"step base ms by tokens {{{base}}}; drafting extra ms by samples {{{extra}}}; "
                f"attention {1e3 * self.per_work:.2f} ms per {WORK_UNIT:.0f} query-row keys{waited}")

    @property
    def busy(self) -> bool:
        """Whether the machine was too busy while these prices were measured to keep them (``BUSY``)."""
        return self.waited is not None and self.waited > BUSY


def _interp(x: float, xs: list[int], ys: list[float]) -> float:
    """``numpy.interp`` for one point (held at the ends), without its per-call cost: the budget
    prices hundreds of candidate steps a step."""
    i = bisect_right(xs, x)
    if i == 0:
        return ys[0]
    if i == len(xs):
        return ys[-1]
    x0, x1 = xs[i - 1], xs[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)


def _medians(pairs) -> list[tuple[int, float]]:
    groups: dict[int, list[float]] = {}
    for x, y in pairs:
        groups.setdefault(x, []).append(y)
    return sorted((x, statistics.median(ys)) for x, ys in groups.items())


def _monotone(points: list[tuple[int, float]], floor: float = 1e-6) -> list[tuple[int, float]]:
    """Sorted by x, each y at least the one before (and at least ``floor``)."""
    out, level = [], floor
    for x, y in sorted(points):
        level = max(level, y)
        out.append((x, level))
    return out


LIVE_WINDOW = 64
"""Recent steps of each kind (plain; drafting, per band of batch sizes) that ``Prices`` keeps."""
LIVE_MIN = 8
"""Steps of each kind (drafting: in the band) needed before a band's live correction applies."""
LIVE_BOUNDS = (0.75, 4.0)
"""The live correction of what drafting adds to a step stays within these factors of the measured
increment."""
LIVE_BANDS = (6, 12, 24, 48, 96)
"""Upper batch sizes of the bands whose drafting steps are corrected apart (the last band is
everything above). What drafting adds is off the measurement by a different factor at each batch
size: on a 2-core Xeon (bfloat16, GSM8K, consensus drafts) drafting steps of 16 samples cost about
0.8x their measured increment, of 64 samples about 1.0x, of 128 samples 1.5-1.8x. One correction
for all of them sat near its lower bound (0.75-0.86, from the small steps) and priced drafts at 128
samples at about half of what they cost: at 8 x 16 in one call the budget drafted a dozen steps of
128 samples a call, each about 10% slower than the tokens it gained were worth."""


def live_band(batch: int, bands: tuple[int, ...] = LIVE_BANDS) -> int:
    """The band of ``bands`` (upper batch sizes) a step of ``batch`` samples belongs to."""
    return bisect_right(bands, batch - 1)


class Prices:
    """The prices the draft budget uses: the measured ``StepCosts``, with what drafting adds to a
    step corrected by what the live steps show.

    The calibration drafts uniform chains of one filler token that is always rejected. Real
    drafts are trees of uneven depth whose accepted paths are walked and committed, with a
    drafter's proposals and the target's likeliest tokens computed for it, and such steps cost
    more or less than the calibration priced them, by a factor that depends on the batch size. So
    the engine records every step: plain steps give the machine's present speed against the
    measurement (the median of observed over priced), and each drafting step, at that speed, what
    it cost beyond the plain step of its samples, against what the measurement says its drafts
    add. Per band of batch sizes (``LIVE_BANDS``), the median of those increments' ratios scales
    the increment of every drafting step of that band the budget prices; the plain part stays as
    measured, and so does the increment of a band that has not drafted ``LIVE_MIN`` steps.

    Only the increment is corrected, because the decision is about the increment: scaling a whole
    drafting step instead let a few percent of noise between the two medians (a plain step of 16
    samples costs 40 ms here, one draft token adds about 5) make drafts look free, and the budget
    then drafted where each draft cost three times what it gained. A correction from medians needs
    no fit, a uniform slowdown of the machine leaves it alone, and it stays where it is while the
    budget drafts nothing."""

    def __init__(self, costs: StepCosts, bands: tuple[int, ...] = LIVE_BANDS):
        """``bands``: upper batch sizes of the bands corrected apart (``()``: one for all)."""
        self.costs = costs
        self.bands = bands
        self.plain: deque[float] = deque(maxlen=LIVE_WINDOW)
        """Observed over priced, per plain step."""
        self.drafting: list[deque[tuple[float, float, float]]] = [
            deque(maxlen=LIVE_WINDOW) for _ in range(len(bands) + 1)]
        """Per band: (observed seconds, price of the same samples without drafts, priced
        increment), per drafting step."""
        self._factors = [1.0] * (len(bands) + 1)
        self._steps = 0
        self._computed = [0] * (len(bands) + 1)
        """Per band, ``_steps`` when its correction was last computed: a band's median is taken
        when the budget first prices a step of it after a recorded step, not for every band at
        every step."""

    def record(self, seconds: float, tokens: int, batch: int, qmax: int, context: int, drafting: int) -> None:
        """A decode step the engine ran: its time and its shape."""
        plain = self.costs.seconds(batch, batch, 1, context)
        if qmax == 1:
            self.plain.append(seconds / plain)
        else:
            increment = self.costs.seconds(tokens, batch, qmax, context, drafting) - plain
            if increment > 0:
                self.drafting[live_band(batch, self.bands)].append((seconds, plain, increment))
        self._steps += 1

    def _factor(self, band: int) -> float:
        if self._computed[band] != self._steps:
            self._computed[band] = self._steps
            steps = self.drafting[band]
            if len(self.plain) >= LIVE_MIN and len(steps) >= LIVE_MIN:
                speed = statistics.median(self.plain)
                factor = statistics.median((observed / speed - base) / increment
                                           for observed, base, increment in steps)
                low, high = LIVE_BOUNDS
                self._factors[band] = min(max(factor, low), high)
        return self._factors[band]

    def pricer(self, batch: int, context: int) -> Callable[..., float]:
        """``StepCosts.pricer`` with this band's correction (``seconds`` for one batch and context)."""
        price = self.costs.pricer(batch, context)
        factor = self._factor(live_band(batch, self.bands))
        if factor == 1.0:
            return price
        plain = price(batch, 1)

        def corrected(tokens: int, qmax: int, drafting: int | None = None) -> float:
            spent = price(tokens, qmax, drafting)
            return spent if qmax == 1 else plain + factor * (spent - plain)

        return corrected

    def drafting_factor(self, batch: int) -> float:
        """How much more drafting adds to a step of ``batch`` samples than measured (the live
        correction of its band)."""
        return self._factor(live_band(batch, self.bands))

    def drafting_factors(self) -> dict[str, float]:
        """Every band's correction, by its batch sizes ("1-6", ..., "97+"), for people."""
        lows = (1,) + tuple(edge + 1 for edge in self.bands)
        names = [f"{lo}-{hi}" for lo, hi in zip(lows, self.bands)] + [f"{lows[-1]}+"]
        return dict(zip(names, (self._factor(band) for band in range(len(self._factors)))))

    def seconds(self, tokens: int, batch: int, qmax: int, context: int, drafting: int | None = None) -> float:
        """``StepCosts.seconds``, with a drafting step's increment over the plain step of its
        samples scaled by its band's ``drafting_factor``."""
        spent = self.costs.seconds(tokens, batch, qmax, context, drafting)
        if qmax == 1:
            return spent
        factor = self._factor(live_band(batch, self.bands))
        if factor == 1.0:
            return spent
        plain = self.costs.seconds(batch, batch, 1, context)
        return plain + factor * (spent - plain)


# ---------------------------------------------------------------------- measuring

class _ChainDrafter:
    """Drafts, for every sample, a chain of ``schedule[k]`` copies of one token at the k-th step
    it is asked: the shapes a calibration wants, whatever the text."""

    alternatives = 0
    min_alternative = 0.0
    sampled = False

    def __init__(self, schedule: list[int], token: int):
        self.schedule, self.token, self.asked = schedule, token, 0

    def add_group(self, group_id, prompt_ids, sample_ids) -> None:
        pass

    def observe(self, sample_id, new_tokens, token_probs=None, alternatives=None) -> None:
        pass

    def remove(self, sample_id) -> None:
        pass

    def propose(self, sample_ids, budgets, uniforms=None):
        from multispec.drafters.base import DraftTree

        length = self.schedule[min(self.asked, len(self.schedule) - 1)]
        self.asked += 1
        tree = DraftTree([self.token] * length, list(range(-1, length - 1)), None) if length else DraftTree.EMPTY
        return [tree if budget >= length else DraftTree.EMPTY for budget in budgets]


def _shapes(max_samples: int, max_model_len: int) -> list[tuple[int, int, list[int]]]:
    """(samples, prompt length, draft length of each timed step) of every calibration request."""
    lengths = [0, *DRAFT_LENGTHS]
    runs = [(b, SHORT_PROMPT, lengths if b in DRAFT_BATCHES else [0]) for b in PLAIN_BATCHES]
    long_prompt = min(LONG_PROMPT, max_model_len // 2)
    runs += [(b, long_prompt, [0]) for b in CONTEXT_BATCHES if long_prompt > 2 * SHORT_PROMPT]
    return [(b, p, ls) for b, p, ls in runs if b <= max_samples]


def measure(engine: "LLMEngine") -> StepCosts:
    """Time decode steps of every calibration shape through a scratch engine on ``engine``'s model.

    ``ROUNDS`` passes over all shapes, the order reversed every other pass, and each shape's
    cheapest pass counts: what else runs on the machine (a burst of another process, the
    scheduler's time slices on a busy CPU) only ever adds time, and spread over passes it reaches
    one shape's passes unevenly, so the cheapest is the one nearest the step's own cost."""
    from multispec.engine.cache import kv_bytes_per_token
    from multispec.engine.engine import EngineConfig, LLMEngine
    from multispec.engine.lane import Lane
    from multispec.params import SamplingParams, SpecConfig

    deepest = max(DRAFT_LENGTHS)
    shapes = _shapes(max(PLAIN_BATCHES), engine.config.max_model_len)
    schedules = [[0] * WARM_STEPS + [lengths[i % len(lengths)] for i in range(REPEATS * len(lengths))]
                 for _, _, lengths in shapes]
    # Room for the largest request alone (each sample holds max_tokens + a draft + 1 tokens), twice.
    need = max(p + b * (len(s) + 2 * deepest + 3) for (b, p, _), s in zip(shapes, schedules))
    per_token = kv_bytes_per_token(engine.model.config, engine.kv_dtype)
    scratch = LLMEngine(engine.model, engine.tokenizer,
                        EngineConfig(engine.config.max_model_len, kv_cache_bytes=2 * need * per_token,
                                     kv_cache_dtype=engine.config.kv_cache_dtype))
    spec = SpecConfig(drafter="ngram", max_draft_tokens=deepest, max_draft_nodes=deepest, adaptive=False)
    timed: dict[tuple[int, int, int], list[tuple[int, float, float]]] = {}
    batch, schedule, step = 0, [0], 0

    def observe(report) -> None:
        """One decode step of the current request: kept if past warm-up and drafted as scheduled."""
        nonlocal step
        length, step = schedule[min(step, len(schedule) - 1)], step + 1
        if step <= WARM_STEPS or any(len(tree) != length for tree in report.trees):
            return
        prompt_len = report.samples[0].request.prompt_len
        context = prompt_len + max(s.cached for s in report.samples)
        seconds = report.time_draft + report.time_forward + report.time_verify + report.time_commit
        timed.setdefault((batch, prompt_len, 1 + length), []).append(
            (report.tokens, work(batch, 1 + length, context, batch if length else 0, report.tokens), seconds))

    scratch.step_observers.append(observe)
    vocab = engine.vocab_size
    passes: dict[tuple[int, int, int], list[tuple[int, float, float]]] = {}
    for round_ in range(ROUNDS):
        order = list(enumerate(zip(shapes, schedules)))
        for k, ((batch, prompt_len, _), schedule) in order if round_ % 2 == 0 else order[::-1]:
            prompt = [(17 + 31 * i) % vocab for i in range(prompt_len)]
            params = SamplingParams(n=batch, temperature=1.0, max_tokens=len(schedule) + deepest + 2,
                                    ignore_eos=True, seed=k)
            request = scratch.make_request(f"calibrate-{round_}-{k}", prompt, params, spec)
            lane = Lane(spec, vocab)
            lane.drafter = _ChainDrafter(schedule, prompt[0])
            scratch.lanes[request.lane] = lane
            scratch.enqueue(request)
            step = 0
            while scratch.has_unfinished_requests() and step < len(schedule):
                scratch.step()
            scratch.abort(request.request_id)
            scratch.lanes.clear()
            for shape, rows in timed.items():  # this pass's median of each shape it ran
                passes.setdefault(shape, []).append(tuple(statistics.median(column) for column in zip(*rows)))
            timed.clear()
    measurements = [Measurement(batch, round(tokens), w, qmax > 1, seconds)
                    for (batch, _, qmax), rows in passes.items()
                    for tokens, w, seconds in [min(rows, key=lambda row: row[2])]]
    return StepCosts.fit(measurements)


# ---------------------------------------------------------------------- the cache

def core_wait() -> dict[str, tuple[int, int]] | None:
    """Per thread of this process, nanoseconds it has run and waited to run on a core so far
    (Linux's per-task ``schedstat``); None where the system does not keep them."""
    times = {}
    try:
        for task in Path("/proc/self/task").iterdir():
            try:
                ran, waited, _ = (int(x) for x in (task / "schedstat").read_text().split())
            except (OSError, ValueError):
                continue  # a thread that ended meanwhile
            times[task.name] = (ran, waited)
    except OSError:
        return None
    return times or None


def waited_share(before: dict[str, tuple[int, int]] | None, after: dict[str, tuple[int, int]] | None) -> float | None:
    """Seconds waited for a core per second run between two ``core_wait`` readings (a thread
    started in between counts from zero)."""
    if before is None or after is None:
        return None
    ran = sum(r - before.get(t, (0, 0))[0] for t, (r, _) in after.items())
    waited = sum(w - before.get(t, (0, 0))[1] for t, (_, w) in after.items())
    return waited / ran if ran > 0 else None


def machine() -> str:
    """The processor the steps run on, as its vendor names it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(engine: "LLMEngine", model_key: str) -> dict:
    """What the step costs depend on: the model, its dtype and device, the machine, the software."""
    from multispec import __version__

    device = engine.device
    processor = torch.cuda.get_device_name(device) if device.type == "cuda" else machine()
    from multispec import kernels
    from multispec.models.llama import affine_rows, stream_rows

    # The kernels' build (their sources and flags), how products stream (AMX tiles, AVX512-BF16
    # vectors or not at all) and up to how many rows, and up to how many rows they read float32
    # weights as integer blocks, change what a step costs, as does what the KV cache stores: any
    # of them re-measures.
    compiled = kernels.build_key() if compiled_kernel(device) is not None else None
    streams = device.type == "cpu" and engine.dtype == kernels.stream_dtype()
    return {"format": FORMAT, "model": model_key, "dtype": str(engine.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(engine.kv_dtype).removeprefix("torch."),
            "device": device.type, "processor": processor, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "multispec": __version__, "compiled_kernels": compiled,
            "stream_products": kernels.stream_kind() if streams else 0,
            "stream_rows": stream_rows() if streams else 0,
            "integer_block_rows": affine_rows() if device.type == "cpu" and engine.dtype == torch.float32 else 0}


def load_or_measure(engine: "LLMEngine", model_key: str | None, cache_dir: Path, refresh: bool = False,
                    even_if_busy: bool = False) -> StepCosts:
    """The engine's step costs from the cache, or measured now (and cached) when not there or
    ``refresh`` is set. No ``model_key`` (an engine built without one): measured, not cached.
    Prices measured on a busy machine (``BUSY``) are returned with a warning and not cached,
    unless ``even_if_busy`` (a machine that is never quiet)."""
    key = cache_key(engine, model_key) if model_key else None
    path = None
    if key is not None:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        path = cache_dir / "step-costs" / f"{digest}.json"
        try:
            stored = json.loads(path.read_text())
            if stored.get("key") == key and not refresh:
                return StepCosts(**stored["costs"])
        except (OSError, ValueError, TypeError, KeyError):
            pass
    log.info("measuring decode step costs for the draft budget (once per machine and model)")
    before = core_wait()
    costs = measure(engine)
    costs.waited = waited_share(before, core_wait())
    log.info("%s", costs.table())
    if costs.busy and not even_if_busy:
        log.warning("the machine was busy while the draft budget's step costs were measured (its threads waited "
                    "for a core %.0f%% of the time they ran: another process, or more threads than cores); this "
                    "process uses them, they are not cached: run `multispec calibrate` when nothing else runs "
                    "(with --even-if-busy it caches them anyway)",
                    100 * costs.waited)
    elif path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            scratch = path.with_suffix(f".{os.getpid()}.tmp")
            scratch.write_text(json.dumps({"key": key, "costs": asdict(costs)}, indent=1))
            scratch.replace(path)
        except OSError as error:
            log.warning("could not cache the step costs in %s (%s); they are measured again next time", path, error)
    return costs
