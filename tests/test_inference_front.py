"""The inference server's hot path: results and streamed tokens cross from the engine's thread to the event loop
in batches (one wake-up per batch), each producer's posts in order, none lost when posts race a drain."""
from __future__ import annotations

import asyncio
import threading
import time

from inference_server.mailbox import Mailbox


def test_mailbox_runs_every_post_in_order_with_fewer_wakeups():
    async def main():
        loop = asyncio.get_running_loop()
        mail, got, wakes = Mailbox(loop), [], []
        real = loop.call_soon_threadsafe

        def counting(*a, **k):
            wakes.append(1)
            return real(*a, **k)

        loop.call_soon_threadsafe = counting
        done = asyncio.Event()

        def producer(tag: str, n: int):
            for i in range(n):
                mail.post(got.append, (tag, i))
                if i % 97 == 0:
                    time.sleep(0.001)  # let the loop drain now and then: posts racing drains
            mail.post(lambda: done.set() if sum(1 for x in got if x[0] == tag) == n else None)

        ts = [threading.Thread(target=producer, args=(t, 3000)) for t in "ab"]
        for t in ts:
            t.start()
        for t in ts:
            await asyncio.to_thread(t.join)
        await asyncio.sleep(0.05)
        return got, len(wakes)

    got, wakes = asyncio.run(main())
    assert len(got) == 6000
    for tag in "ab":  # each producer's posts run in the order it made them, none lost, none twice
        assert [i for t, i in got if t == tag] == list(range(3000))
    assert wakes < 6000 // 2
