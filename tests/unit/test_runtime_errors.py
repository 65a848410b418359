"""The runtime's error helpers: each call to a lost peer gets an error of its own, saying the same."""

from __future__ import annotations

import pytest

from rlasync.runtime.errors import NodeLostError, lost_again


@pytest.mark.parametrize("graceful", [True, False])
def test_a_lost_peers_next_error_says_the_same_and_keeps_graceful(graceful: bool) -> None:
    first = NodeLostError("node-2", "no heartbeat for 2.0s: a: b", graceful=graceful)
    again = lost_again(first)
    assert again is not first and isinstance(again, NodeLostError)
    assert (again.node, str(again), again.graceful) == ("node-2", str(first), graceful)
