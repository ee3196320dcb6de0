"""The hand-over of engine events to the event loop (launch/server/sse.py): every event reaches its
request's queue, in order, and events posted before the loop runs share one wake-up."""

import asyncio
import threading

from hetero_run.launch.server.sse import Channel, Mailbox
from hetero_run.runtime.engine.api import GenerationEvent


def test_events_posted_together_share_one_wake_up_and_keep_their_order():
    loop = asyncio.new_event_loop()
    try:
        wake_ups = []
        schedule = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args: (wake_ups.append(args), schedule(*args))[1]
        box = Mailbox(loop)
        seen = []
        channels = [Channel(box, observe=seen.append) for _ in range(3)]

        def engine(step: int):  # an engine step: one event per request, then finals on the last step
            for i, channel in enumerate(channels):
                channel.sink(GenerationEvent(f"r{i}", text=f"{step}", finish_reason="stop" if step == 4 else None))

        for step in range(3):  # the loop does not run in between: every event waits for one wake-up
            worker = threading.Thread(target=engine, args=(step,))
            worker.start()
            worker.join()
        assert len(wake_ups) == 1 and len(seen) == 9
        loop.run_until_complete(asyncio.sleep(0))
        for step in (3, 4):  # delivered between steps: each step wakes the loop once
            engine(step)
            loop.run_until_complete(asyncio.sleep(0))
        assert len(wake_ups) == 3

        async def drain(channel):
            return [await channel.next() for _ in range(5)]

        for i, channel in enumerate(channels):
            events = loop.run_until_complete(drain(channel))
            assert [e.text for e in events] == ["0", "1", "2", "3", "4"] and {e.request_id for e in events} == {f"r{i}"}
            assert events[-1].final and channel.finished and channel.queue.empty()
    finally:
        loop.close()


def test_posting_after_the_loop_closed_is_dropped_quietly():
    loop = asyncio.new_event_loop()
    box = Mailbox(loop)
    loop.close()
    Channel(box).sink(GenerationEvent("r", text="late"))  # the server is gone: nobody listens, nothing raises
