"""``AsyncLLM``: concurrent asyncio readers stream their requests; a reader that cancels aborts its
request and its slots go to the next waiting request at once."""

from __future__ import annotations

import asyncio

import pytest

from multispec import LLM, AsyncLLM, RequestOutputKind, SamplingParams, SpecConfig
from multispec.engine.cache import kv_bytes_per_token
from tests.tiny_models import chain

SPEC = SpecConfig(drafter="consensus", max_draft_tokens=3, max_draft_nodes=3, adaptive=False)


def requests(tiny) -> dict[str, tuple[list[int], SamplingParams]]:
    successor = (tiny.model.model.embed_tokens.weight @ tiny.model.output_weight().T).argmax(-1).tolist()
    long = dict(n=4, temperature=1.0, max_tokens=60, ignore_eos=True)
    short = dict(n=4, temperature=1.0, max_tokens=20, ignore_eos=True)
    return {"long": (chain(successor, 3, 8), SamplingParams(seed=1, **long)),
            "cancelled": (chain(successor, 5, 8), SamplingParams(seed=2, **long)),
            "waiting-1": (chain(successor, 7, 8), SamplingParams(seed=3, **short)),
            "waiting-2": (chain(successor, 9, 8), SamplingParams(seed=4, **short))}


async def read(stream, cancel_after: int | None = None):
    """Concatenate a request's delta outputs per sample; the last output comes back too."""
    tokens: dict[int, list[int]] = {}
    last, count = None, 0
    async for out in stream:
        for c in out.outputs:
            tokens.setdefault(c.index, []).extend(c.token_ids)
        last, count = out, count + 1
        if cancel_after is not None and count == cancel_after:
            await asyncio.sleep(3600)  # the test cancels this reader here
    return tokens, last


def test_concurrent_readers_and_a_cancelled_one(tiny, successor_dir):
    jobs = requests(tiny)
    want = {name: [c.token_ids for c in tiny.generate([ids], sp, SPEC, use_tqdm=False)[0].outputs]
            for name, (ids, sp) in jobs.items()}
    one = 4 * (60 + 3 + 1) + 8
    # Room for two of these requests at a time: the waiting ones get in only as slots free up.
    llm = LLM(str(successor_dir), device="cpu", dtype="float32", kv_cache_memory=2.2 * one * kv_bytes_per_token(tiny.config, tiny.engine.dtype) / 2**30)

    async def main():
        async_llm = AsyncLLM(llm)
        try:
            tasks = {name: asyncio.create_task(read(async_llm.generate(ids, sp, request_id=name, spec=SPEC),
                                                    cancel_after=3 if name == "cancelled" else None))
                     for name, (ids, sp) in jobs.items()}
            while llm.engine.stats.decode_forwards < 3:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            tasks["cancelled"].cancel()
            results = {name: await task for name, task in tasks.items() if name != "cancelled"}
            with pytest.raises(asyncio.CancelledError):
                await tasks["cancelled"]
            assert async_llm.healthy
            return results
        finally:
            async_llm.shutdown()

    results = asyncio.run(main())
    for name, (tokens, last) in results.items():
        assert last.finished and [tokens[i] for i in range(4)] == want[name], name
    # The cancelled request's slots went to a waiting one while the long one still ran.
    assert results["waiting-1"][1].metrics.first_token_time < results["long"][1].metrics.finished_time
    assert not llm.engine.has_unfinished_requests() and not llm.engine.scheduler.slots


def test_bad_requests_raise_when_read_and_the_loop_stays_healthy(tiny):
    async def main():
        async_llm = AsyncLLM(tiny)
        try:
            with pytest.raises(ValueError, match="logprobs"):
                async for _ in async_llm.generate([5, 6], SamplingParams(logprobs=10**6)):
                    pass
            first = async_llm.generate([5, 6], SamplingParams(max_tokens=30, ignore_eos=True), request_id="dup")
            got = await first.__anext__()
            with pytest.raises(ValueError, match="already in use"):
                async for _ in async_llm.generate([5, 6], SamplingParams(), request_id="dup"):
                    pass
            rest = [out async for out in first]
            assert (rest or [got])[-1].finished
            cumulative = [out async for out in async_llm.chat([{"role": "user", "content": "hi"}],
                                                              SamplingParams(max_tokens=5, ignore_eos=True),
                                                              output_kind=RequestOutputKind.CUMULATIVE)]
            assert len(cumulative[-1].outputs[0].token_ids) == 5
            assert async_llm.healthy
            with pytest.raises(RuntimeError, match="AsyncLLM"):  # one driver at a time
                tiny.generate([[5, 6]], SamplingParams())
            with pytest.raises(RuntimeError, match="AsyncLLM"):
                tiny.reset_prefix_cache()
            # The prefix cache, emptied on the engine's thread.
            prompt, once = list(range(40, 90)), SamplingParams(max_tokens=2, ignore_eos=True)
            cached = []
            for reset in (False, False, True):
                if reset:
                    assert await async_llm.reset_prefix_cache()
                outs = [out async for out in async_llm.generate(prompt, once, output_kind=RequestOutputKind.CUMULATIVE)]
                cached.append(outs[-1].num_cached_tokens)
            assert cached[1] == len(prompt) - 1 and cached[2] == 0
        finally:
            async_llm.shutdown()

    asyncio.run(main())
    assert not tiny.engine.has_unfinished_requests()
    assert tiny.generate([[5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids
