"""The multinode tier's fixtures (root only: network namespaces)."""

from __future__ import annotations

from typing import Iterator

import pytest
from hosts import Hosts, make_hosts


@pytest.fixture
def two_hosts() -> Iterator[Hosts]:
    yield from make_hosts("10.231.7")  # only inside the namespaces this fixture makes
