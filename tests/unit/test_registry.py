"""``rlasync.registry.Registry``: what every registry in the package is built on."""

from __future__ import annotations

import pytest

from rlasync.registry import Registry


def test_registering_again_replaces() -> None:
    reg = Registry[int]("number")
    assert reg.register("one", 1) == 1
    reg.register("one", 11)
    assert reg.get("one") == 11 and "one" in reg and "two" not in reg

    @reg.decorator("two")
    def two() -> int:
        return 2

    assert reg.get("two") is two and reg.names() == ["one", "two"]


def test_an_unknown_name_lists_the_registered_ones_sorted() -> None:
    reg = Registry[int]("number")
    for name in ("zeta", "alpha", "mid"):
        reg.register(name, 0)
    with pytest.raises(KeyError, match="unknown number 'nope'; registered: alpha, mid, zeta"):
        reg.get("nope")
    custom = Registry[int]("number", unknown="no {kind} {name!r} in {names}", error=LookupError)
    custom.register("b", 0)
    custom.register("a", 0)
    with pytest.raises(LookupError, match=r"no number 'x' in \['a', 'b'\]") as info:
        custom.get("x")
    assert info.value.__suppress_context__  # the registry's own KeyError is not shown


class First:
    pass


def test_a_refusing_registry_keeps_the_first_value() -> None:
    reg = Registry[type]("class", taken="{name!r} is taken by {old.__qualname__}")
    reg.register("c", First)
    reg.register("c", type("First", (), {"__module__": __name__}))  # defined again: replaces
    with pytest.raises(ValueError, match="'c' is taken by First"):
        reg.register("c", int)
    reg.register("c", int, replace=True)
    assert reg.get("c") is int

    def one() -> int:
        return 1

    by_identity = Registry[object]("function", taken="{name} taken", same=lambda old, new: old is new)
    by_identity.register("f", one)
    by_identity.register("f", one)  # the same function again: fine
    with pytest.raises(ValueError, match="f taken"):
        by_identity.register("f", lambda: 1)


def test_copy_and_view() -> None:
    reg = Registry[int]("number", taken="taken")
    reg.register("a", 1)
    other = reg.copy()
    other.register("b", 2)
    assert reg.names() == ["a"] and other.names() == ["a", "b"]
    with pytest.raises(ValueError, match="taken"):
        other.register("a", 3)
    view = reg.view()
    reg.register("c", 3)
    assert dict(view) == {"a": 1, "c": 3}
