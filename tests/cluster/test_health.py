"""cluster.health without Ray: what one ping says of a worker, and the line a lost worker
gets (whether its node is still alive)."""

from __future__ import annotations

import pytest

from cluster.health import Verdict, lost_line, verdict
from tests.cluster.workers import worker


@pytest.mark.parametrize(
    "healthy, answer, expected",
    [
        (True, "inc-1", Verdict.HEALTHY),
        (False, "inc-1", Verdict.BACK),
        (True, "inc-2", Verdict.RESTARTED),
        (False, "inc-2", Verdict.RESTARTED),  # restarted while it did not answer
        (True, TimeoutError("no answer"), Verdict.LOST),
        (False, TimeoutError("no answer"), Verdict.STILL_LOST),
    ],
)
def test_verdict_of_one_ping(healthy, answer, expected):
    assert verdict(worker("decode-0", incarnation="inc-1", healthy=healthy), answer) is expected


def test_lost_line_says_whether_the_node_is_still_alive():
    w = worker("decode-0", node_id="0123456789abcdef")
    exc = RuntimeError("actor died\nThe actor died unexpectedly")
    assert lost_line(w, exc, {"0123456789abcdef", "ff"}) == (
        "decode-0 lost: no answer (The actor died unexpectedly); its node 01234567 is alive "
        "(its process died; Ray restarts it there)"
    )
    assert lost_line(w, exc, {"ff"}) == (
        "decode-0 lost: no answer (The actor died unexpectedly); its node 01234567 is gone "
        "(Ray restarts it where its bundle fits again)"
    )
    assert lost_line(worker("prefill-0"), exc, set()).startswith(
        "prefill-0 lost: no answer (The actor died unexpectedly); its node ? is gone"
    )
