"""The web process's shared stream read (gateway/web/stream_reads.py): one
blocking XREAD for every subscribed stream, against the real Redis."""

from __future__ import annotations

import asyncio
import random
import time

import prometheus_client
import pytest

from budgets.redis.clients import REDIS_UNAVAILABLE, get_redis, reset_clients
from budgets.redis.composition import Commands
from gateway.core import keys
from gateway.core.request.streams import CHUNK_FIELD, stream_append
from gateway.web import stream_reads
from gateway.web.stream_reads import STREAM_READ_BATCH, stream_subscribe


def _run(coro):
    reset_clients()  # the async clients belong to the loop that made them
    try:
        return asyncio.run(coro)
    finally:
        reset_clients()


async def _append(request_id: str, chunks: list[str]) -> None:
    # a worker's append, from a thread as a lane worker makes it, naming the
    # request on this loop's notice stream as its record says
    wake = stream_reads.stream_wake_key()
    await asyncio.to_thread(stream_append, get_redis(), request_id=request_id, chunks=chunks, watch=False, wake=wake)


async def _append_unnoticed(request_id: str, chunks: list[str]) -> None:
    # an append whose notice was lost
    await asyncio.to_thread(stream_append, get_redis(), request_id=request_id, chunks=chunks, watch=False)


async def _read_all(sub, count: int, timeout_s: float = 10) -> list[str]:
    got: list[str] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got += [fields[CHUNK_FIELD] for _, fields in await sub.read(1.0)]
    return got


def test_two_hundred_streams_each_get_their_own_chunks_in_order_from_one_read(redis_client):
    async def main():
        # given 200 subscribed streams and writers appending to them at random moments
        ids = [f"req_reads_{i}" for i in range(200)]
        subs = [stream_subscribe(keys.request_stream(i)) for i in ids]
        rng = random.Random(3)

        async def write(request_id: str) -> None:
            for n in range(10):
                await asyncio.sleep(rng.random() * 0.02)
                await _append(request_id, [f"{request_id}:{n}"])

        readers = [asyncio.create_task(_read_all(sub, 10)) for sub in subs]
        await asyncio.gather(*(write(i) for i in ids))
        results = await asyncio.gather(*readers)
        # then every stream's reader got exactly its own ten chunks, in order
        for request_id, got in zip(ids, results):
            assert got == [f"{request_id}:{n}" for n in range(10)]
        # and one reader task served them all
        reader = stream_reads._reader_of_loop()
        assert reader.task is not None and reader.task.get_name() == "stream-reads"
        for sub in subs:
            sub.close()
        assert reader.subs == {}

    _run(main())


def test_a_stream_subscribed_while_the_read_is_blocked_wakes_it_at_once(redis_client):
    async def main():
        # given the shared read blocked on one quiet stream
        quiet = stream_subscribe(keys.request_stream("req_quiet"))
        await asyncio.sleep(0.2)
        reader = stream_reads._reader_of_loop()
        assert reader.reading
        # when a second stream subscribes and gets a chunk
        late = stream_subscribe(keys.request_stream("req_late"))
        started = time.monotonic()
        await _append("req_late", ["hello"])
        got = await late.read(3.0)
        # then its chunk comes well before the read's own 5 s timeout
        assert [fields[CHUNK_FIELD] for _, fields in got] == ["hello"]
        assert time.monotonic() - started < 1.0
        quiet.close()
        late.close()

    _run(main())


def test_a_chunk_appended_before_the_subscription_is_read_from_the_start(redis_client):
    async def main():
        await _append("req_early", ["a", "b"])
        sub = stream_subscribe(keys.request_stream("req_early"))
        assert await _read_all(sub, 2) == ["a", "b"]
        sub.close()

    _run(main())


def test_a_quiet_stream_times_out_empty_and_a_slow_reader_catches_up_whole(redis_client):
    async def main():
        sub = stream_subscribe(keys.request_stream("req_slow"))
        started = time.monotonic()
        assert await sub.read(0.3) == []
        assert 0.25 <= time.monotonic() - started < 2.0
        # when far more chunks than one read's batch come while its caller does not read
        chunks = [str(n) for n in range(STREAM_READ_BATCH * 3 + 7)]
        for at in range(0, len(chunks), 100):
            await _append("req_slow", chunks[at:at + 100])
        await asyncio.sleep(0.3)
        # then it holds no more than about a batch meanwhile, and gets every chunk in order
        assert len(sub.entries) <= 2 * STREAM_READ_BATCH
        assert await _read_all(sub, len(chunks)) == chunks
        sub.close()

    _run(main())


def test_a_lost_connection_fails_every_subscriber_and_the_next_read_starts_afresh(redis_client):
    async def main():
        subs = [stream_subscribe(keys.request_stream(f"req_lost_{i}")) for i in range(3)]
        await asyncio.sleep(0.2)
        reader = stream_reads._reader_of_loop()
        # when Redis drops the shared read's connection (named for its reader)
        blocked = [c for c in redis_client.client_list() if c["name"] == reader.name]
        assert len(blocked) == 1 and blocked[0]["cmd"] == "xread"
        redis_client.client_kill_filter(_id=blocked[0]["id"])
        for sub in subs:
            with pytest.raises(REDIS_UNAVAILABLE):
                await sub.read(3.0)
        assert reader.subs == {}
        # then a new subscription reads again
        fresh = stream_subscribe(keys.request_stream("req_after"))
        await _append("req_after", ["x"])
        assert await _read_all(fresh, 1) == ["x"]
        fresh.close()

    _run(main())


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_read_hands_the_same_entries_whatever_protocol_its_connection_speaks(redis_client, settings, monkeypatch,
                                                                               protocol):
    # given a reader whose connection speaks RESP2 or RESP3 (XREAD answers a
    # list of pairs in one, a map in the other)
    import redis.asyncio as aioredis

    monkeypatch.setattr(stream_reads, "async_reader_client", lambda *, name: aioredis.Redis.from_url(
        settings.REDIS_URL, protocol=protocol, decode_responses=True, client_name=name))

    async def main():
        subs = [stream_subscribe(keys.request_stream(f"req_resp{protocol}_{i}")) for i in range(3)]
        for i in range(3):
            await _append(f"req_resp{protocol}_{i}", [f"{i}:a", f"{i}:b"])
        got = [await _read_all(sub, 2) for sub in subs]
        for sub in subs:
            sub.close()
        return got

    # then each stream's entries come as (id, fields) with its own chunks, in order
    assert _run(main()) == [[f"{i}:a", f"{i}:b"] for i in range(3)]


def _reads_on_metrics() -> tuple[float, float]:
    """The shared reads made and the streams they named, as /metrics counts
    them (sluice_web_stream_read_streams)."""
    sample = prometheus_client.REGISTRY.get_sample_value
    return (sample("sluice_web_stream_read_streams_count") or 0.0,
            sample("sluice_web_stream_read_streams_sum") or 0.0)


def test_a_read_names_only_the_noticed_streams_not_every_stream_it_relays(redis_client):
    async def main():
        # given 300 quiet streams
        ids = [f"req_notice_{i}" for i in range(300)]
        subs = {i: stream_subscribe(keys.request_stream(i)) for i in ids}
        await asyncio.sleep(0.3)
        reader = stream_reads._reader_of_loop()
        assert reader.reading
        # (the read that is out names all 300: each is new, so due once)
        await _append(ids[0], ["first"])
        assert len(await subs[ids[0]].read(3.0)) == 1
        await asyncio.sleep(0.1)
        reads, named = _reads_on_metrics()
        # when 30 of them get a chunk, one after another, each read by its subscriber
        rng = random.Random(5)
        for n, request_id in enumerate(rng.sample(ids[1:], 30)):
            started = time.monotonic()
            await _append(request_id, [f"{request_id}:{n}"])
            got = await subs[request_id].read(3.0)
            # then each chunk comes at once
            assert [fields[CHUNK_FIELD] for _, fields in got] == [f"{request_id}:{n}"]
            assert time.monotonic() - started < 1.0
        # and the reads that brought them named a few streams each, not the
        # 300, as /metrics shows them
        reads_after, named_after = _reads_on_metrics()
        reads, named = reads_after - reads, named_after - named
        assert reads >= 30
        assert named <= 2 * reads
        for sub in subs.values():
            sub.close()
        assert reader.subs == {} and reader.due == set()

    _run(main())


def test_a_stream_whose_notice_never_came_is_read_after_its_quiet_wait(redis_client):
    async def main():
        # given a stream the shared read already looked at, and read past
        # (another stream's chunk and notice ended that read)
        sub = stream_subscribe(keys.request_stream("req_unnoticed"))
        other = stream_subscribe(keys.request_stream("req_other"))
        await asyncio.sleep(0.3)
        await _append("req_other", ["x"])
        assert len(await other.read(3.0)) == 1
        await asyncio.sleep(0.2)
        # when a chunk is appended with no notice (as if it were lost)
        await _append_unnoticed("req_unnoticed", ["late"])
        # then its subscriber's quiet wait ends empty, and the next wait reads the chunk at once
        assert await sub.read(0.3) == []
        started = time.monotonic()
        assert [fields[CHUNK_FIELD] for _, fields in await sub.read(3.0)] == ["late"]
        assert time.monotonic() - started < 1.0
        sub.close()
        other.close()

    _run(main())


def test_a_reader_a_whole_batch_of_notices_behind_reads_every_stream(redis_client):
    async def main():
        wake = stream_reads.stream_wake_key()
        subs = [stream_subscribe(keys.request_stream(f"req_behind_{i}")) for i in range(5)]
        await asyncio.sleep(0.3)
        await _append("req_behind_0", ["x"])  # the read past the one that named them all
        assert len(await subs[0].read(3.0)) == 1
        await asyncio.sleep(0.2)
        # given a chunk appended to one stream with no notice of its own
        await _append_unnoticed("req_behind_3", ["missed"])
        # when a whole batch of notices of other requests comes (its own may have been trimmed among them)
        commands = Commands()
        for n in range(STREAM_READ_BATCH + 10):
            commands.command("XADD", wake, "*", "r", f"req_elsewhere_{n}")
        await asyncio.to_thread(commands.run, get_redis())
        # then the next read names every stream: the chunk comes well before the quiet wait's end
        started = time.monotonic()
        assert [fields[CHUNK_FIELD] for _, fields in await subs[3].read(3.0)] == ["missed"]
        assert time.monotonic() - started < 1.0
        for sub in subs:
            sub.close()

    _run(main())
