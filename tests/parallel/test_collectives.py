"""The handle of an asynchronous collective yields its result only after the transfer completed.

Single-process checks of :class:`hf_bdlm.parallel.collectives.InFlight` with a fake work object; the
collectives themselves run for real under torchrun in tests/parallel/test_exactness.py and
tests/parallel/test_mixed_precision.py.
"""

from datetime import timedelta

import pytest

from hf_bdlm.parallel.collectives import ByteMeter, CollectiveTimeout, CommContext, InFlight


class FakeWork:
    def __init__(self, log, completes=True):
        self.log, self.completes = log, completes

    def wait(self, timeout=None):
        self.log.append("wait")
        return self.completes


def comm():
    return CommContext(None, "ring[0]", ByteMeter(), timedelta(seconds=1))


def test_result_is_built_only_after_every_work_completed():
    log = []
    handle = InFlight(comm(), [FakeWork(log), FakeWork(log)], "all_gather(k)", lambda: log.append("read") or "rows")
    assert log == []  # starting reads nothing
    assert handle.wait() == "rows"
    assert log == ["wait", "wait", "read"]


def test_wait_is_idempotent_and_returns_the_same_result():
    log = []
    result = object()
    handle = InFlight(comm(), [FakeWork(log)], "all_gather(k)", lambda: result)
    assert handle.wait() is result and handle.wait() is result
    assert log == ["wait"]


def test_the_handle_exposes_no_buffer_before_the_wait():
    handle = InFlight(comm(), [FakeWork([])], "all_gather(k)", lambda: "rows", keep=("send buffer",))
    public = [name for name in dir(handle) if not name.startswith("_")]
    assert public == ["wait"]
    with pytest.raises(AttributeError):
        handle.result  # noqa: B018


def test_a_work_that_does_not_complete_raises_naming_group_collective_and_step():
    c = comm()
    c.meter.step = 7
    handle = InFlight(c, [FakeWork([], completes=False)], "all_gather(k)", lambda: "rows")
    with pytest.raises(CollectiveTimeout, match=r"all_gather\(k\) on process group 'ring\[0\]' \(ranks .*\) timed out .* at step 7"):
        handle.wait()
