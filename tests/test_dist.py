"""The communicator's waits, without a GPU: which stream waits for what."""
import contextlib

import pytest

from sinkprof import dist


def test_a_wait_holds_the_callers_stream_for_its_own_work_not_for_the_communication_streams_tail(monkeypatch):
    """Over NCCL a message's wait makes the communication stream wait for its work (where the
    profile marks its end) and then the caller's stream wait for that same work, never for the
    communication stream itself: its tail also waits for every stream that posted since (step 0
    beside the next step, ``ring.Beside``), which would hold the next step back."""
    current, waits = ["compute"], []

    @contextlib.contextmanager
    def on(stream):
        before, current[0] = current[0], stream
        yield
        current[0] = before

    class Comm:
        stream = "communication"

        def wait_all(self, works, what):
            waits.append((current[0], works))
    monkeypatch.setattr(dist.torch.cuda, "stream", on)
    monkeypatch.setattr(dist.torch.cuda, "current_stream",
                        lambda *_: pytest.fail("waited for the communication stream's tail"))
    dist.Pending(["work"], [], Comm(), "bwd step 0 dkv exchange").wait()
    assert waits == [("communication", ["work"]), ("compute", ["work"])]
