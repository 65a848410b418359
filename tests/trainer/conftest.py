"""A warm-started reverse model shared by the trainer tests (about 50 s once per session)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from rlasync.models.warmstart import DEFAULT_SETTINGS, warm_start


@pytest.fixture(scope="session")
def reverse_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The quickstart's warm-start (seed 1): greedy accuracy about 0.25, so GRPO groups hold
    # right and wrong samples and the losses the tests compare are not all zero.
    settings = msgspec.structs.replace(DEFAULT_SETTINGS["reverse"], greedy_threshold=0.4)
    return warm_start("reverse", run_dir=tmp_path_factory.mktemp("warm"), seed=1, settings=settings)
