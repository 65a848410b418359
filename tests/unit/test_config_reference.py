"""The config reference (``rlasync.config.reference``): generated from the Structs, every setting
documented, and the pages under ``docs/reference/config`` are what the Structs say now."""

from __future__ import annotations

from pathlib import Path

from rlasync.config.reference import pages, settings

PAGES = Path(__file__).parents[2] / "docs" / "reference" / "config"
REGENERATE = "python -m rlasync.config.reference docs/reference/config"


def test_every_setting_has_a_docstring() -> None:
    undocumented = [s.path for s in settings() if not s.doc.strip()]
    assert not undocumented, f"settings without a docstring under their field: {undocumented}"


def test_the_reference_pages_are_the_structs_as_they_are() -> None:
    expected = pages()
    written = {p.name: p.read_text() for p in PAGES.glob("*.md")}
    stale = sorted(
        name for name in expected.keys() | written.keys() if expected.get(name) != written.get(name)
    )
    assert not stale, f"the config reference is out of date ({stale}): run `{REGENERATE}`"


def test_nested_sections_and_every_backend_are_listed() -> None:
    entries = {s.path: s for s in settings()}
    assert {"trainer.lora.rank", "trainer.lora.sync", "cluster.colocate", "agent.mcp_servers.command"} <= set(
        entries
    )
    assert (
        entries["engine.max_lora_rank"].only == "vllm"
        and entries["engine.engine_kwargs"].only == "vllm, sglang"
    )
    assert entries["engine.model"].only == "" and entries["engine.base_s"].only == "sim"
    assert entries["trainer.lr"].type == "float > 0" and entries["trainer.lr"].default == "0.001"
