"""The multinode tier's fixtures (root only: network namespaces)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hosts import Hosts, Lan, make_hosts, make_lan


@pytest.fixture
def two_hosts() -> Iterator[Hosts]:
    yield from make_hosts("10.231.7")  # only inside the namespaces this fixture makes


@pytest.fixture
def three_hosts() -> Iterator[Lan]:
    yield from make_lan(3, "10.231.9", "fd00:231:9")  # only inside the namespaces this fixture makes
