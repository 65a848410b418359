"""The runtime's error helpers: each call to a lost peer gets an error of its own, saying the same;
an error inside a message is its first line."""

from __future__ import annotations

import pytest

from rlasync.runtime.errors import NodeLostError, first_line, lost_again


@pytest.mark.parametrize("graceful", [True, False])
def test_a_lost_peers_next_error_says_the_same_and_keeps_graceful(graceful: bool) -> None:
    first = NodeLostError("node-2", "no heartbeat for 2.0s: a: b", graceful=graceful)
    again = lost_again(first)
    assert again is not first and isinstance(again, NodeLostError)
    assert (again.node, str(again), again.graceful) == ("node-2", str(first), graceful)


def test_an_error_inside_a_message_is_its_first_line_cut_or_its_type() -> None:
    long = RuntimeError("Connection closed by peer [10.0.0.2]:29500\n" + "frame\n" * 500)
    assert first_line(long) == "Connection closed by peer [10.0.0.2]:29500"
    assert first_line(ValueError("x" * 500), 200) == "x" * 200
    assert first_line(TimeoutError()) == "TimeoutError"  # no text: its type, not an IndexError
