"""PendingWrite, the way the sender hands each message to gRPC: a write that goes on when its call is
cut, so that the stream budget can keep the message charged until gRPC lets go of it."""

from __future__ import annotations

import asyncio

import pytest

from encoder_server.sender import PendingWrite


class Write:
    """A stand-in for `context.write`: waits on futures the test resolves, and records what it saw."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.steps = [loop.create_future(), loop.create_future()]
        self.seen: list[object] = []

    async def run(self, fail: Exception | None = None) -> None:
        for step in self.steps:
            try:
                self.seen.append(await step)
            except asyncio.CancelledError:
                self.seen.append("cancelled")
                raise
        await asyncio.sleep(0)  # a bare yield, as asyncio.sleep(0) makes
        if fail is not None:
            raise fail


async def wait_for_it(pending: PendingWrite) -> None:
    await pending.done


async def test_done_resolves_once_the_write_has_gone_through_every_future_it_waits_on():
    write = Write()
    pending = PendingWrite(write.run())
    write.steps[0].set_result("first")
    await asyncio.sleep(0.01)
    assert not pending.done.done()
    write.steps[1].set_result("second")
    assert await asyncio.wait_for(pending.done, 1) is None
    assert write.seen == ["first", "second"]
    assert pending.finished().done()


async def test_a_failing_write_fails_done_with_its_exception():
    write = Write()
    pending = PendingWrite(write.run(fail=RuntimeError("the call is over")))
    for step in write.steps:
        step.set_result(None)
    with pytest.raises(RuntimeError, match="the call is over"):
        await asyncio.wait_for(pending.done, 1)


async def test_a_cut_call_leaves_its_write_going_and_finished_tells_when_it_is_over():
    write = Write()
    pending = PendingWrite(write.run())
    call = asyncio.ensure_future(wait_for_it(pending))  # a call sending the message ...
    await asyncio.sleep(0)
    call.cancel()  # ... that the budget cuts
    with pytest.raises(asyncio.CancelledError):
        await call
    assert pending.done.cancelled()
    finished = pending.finished()
    write.steps[0].set_result("first")
    await asyncio.sleep(0.01)
    assert not finished.done() and write.seen == ["first"]  # the message is still inside gRPC
    write.steps[1].set_result("second")
    await asyncio.wait_for(finished, 1)
    assert write.seen == ["first", "second"]  # the write went on to its end, never cancelled


async def test_cancel_stops_the_write_where_it_waits_as_cancelling_a_task_would():
    write = Write()
    pending = PendingWrite(write.run())
    write.steps[0].set_result("first")
    await asyncio.sleep(0.01)
    pending.cancel()
    await asyncio.wait_for(pending.finished(), 1)
    assert write.seen == ["first", "cancelled"]
    assert pending.done.cancelled()
