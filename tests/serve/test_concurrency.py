"""Many clients at once through the official async client: mixed n, streamed and not, one bad
request and one client that leaves mid-stream. Every good request gets exactly its n choices,
and the server is healthy and idle afterwards."""

from __future__ import annotations

import asyncio

import openai
import pytest

CHAT = [{"role": "user", "content": "The quick brown fox"}]


async def good_request(client, k: int) -> tuple[int, dict[int, int]]:
    """Request k (n from 1 to 16, chat or completions, streamed or not): n, and how many finish
    reasons each choice index got."""
    n = [1, 2, 4, 8, 16][k % 5]
    common = dict(model="tiny", n=n, max_tokens=8 + k, temperature=1.0, seed=k)
    chat = k % 2 == 0
    create = client.chat.completions.create if chat else client.completions.create
    inputs = dict(messages=CHAT) if chat else dict(prompt=f"The lazy dog {k}")
    finishes: dict[int, int] = {}
    if k % 3:
        for choice in (await create(**inputs, **common)).choices:
            finishes[choice.index] = finishes.get(choice.index, 0) + (choice.finish_reason is not None)
        return n, finishes
    async for chunk in await create(stream=True, **inputs, **common):
        for choice in chunk.choices:
            finishes[choice.index] = finishes.get(choice.index, 0) + (choice.finish_reason is not None)
    return n, finishes


async def bad_request(client) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model="tiny", prompt="hi", n=4, temperature=-1.0)
    return caught.value


async def leaving_request(client) -> int:
    """Reads two chunks of a long stream, then disconnects."""
    stream = await client.completions.create(model="tiny", prompt="The lazy dog", n=4, max_tokens=200,
                                             temperature=1.0, stream=True, extra_body={"ignore_eos": True})
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 2:
            break
    await stream.close()
    return seen


def test_concurrent_clients_mixed_n_with_a_bad_and_a_leaving_one(server, async_client):
    async def main():
        client = async_client()
        try:
            return await asyncio.gather(*(good_request(client, k) for k in range(18)), bad_request(client),
                                        leaving_request(client))
        finally:
            await client.close()

    *good, bad, seen = asyncio.run(main())
    assert len(good) == 18 and all(finishes == dict.fromkeys(range(n), 1) for n, finishes in good), good
    assert bad.status_code == 400 and bad.body["param"] == "temperature"
    assert seen == 2
    assert server.request("GET", "/health")[0] == 200

    def idle():
        samples = server.metrics()
        return (samples["multispec_requests_running"] == samples["multispec_requests_waiting"] == 0
                and samples["multispec_samples_running"] == 0)

    server.wait_until(idle, "the server to have no request left")
