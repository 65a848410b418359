"""``rlasync.plugins``: a module by name or a file by path, imported once per process; a plugin
that is missing or raises is a ``PluginError`` (a ``ConfigError``) naming it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rlasync.config import ConfigError
from rlasync.plugins import PluginError, is_file, load, load_all, resolved


def test_a_file_is_imported_once_under_a_name_of_its_own(tmp_path: Path) -> None:
    plugin = tmp_path / "my-plugin.py"
    plugin.write_text("LOADS = []\nLOADS.append(1)\nclass Thing:\n    pass\n")
    first = load(str(plugin))
    again = load(str(tmp_path / "." / "my-plugin.py"))  # another spelling of the same file
    assert first is again and first.LOADS == [1]
    assert first.__name__.startswith("rlasync_plugin_my_plugin_") and sys.modules[first.__name__] is first
    assert first.Thing.__module__ == first.__name__  # classes it defines can be found again by module


def test_module_names_and_paths_are_told_apart_and_paths_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert not is_file("my_package.rl") and is_file("plugin.py") and is_file("dir/plugin")
    assert resolved(["json", "./p.py", "p.py", "json"]) == ("json", str(tmp_path / "p.py"))
    assert [m.__name__ for m in load_all(["json", "rlasync.rewards"])] == ["json", "rlasync.rewards"]


def test_a_plugin_that_is_missing_or_raises_is_a_config_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(
        PluginError, match=r"plugin 'no_such_pkg\.x': no module named 'no_such_pkg' \(install it"
    ):
        load("no_such_pkg.x")
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_dependency_here\n")
    with pytest.raises(
        PluginError, match=r"failed while importing: ModuleNotFoundError: .*broken\.py:1\)"
    ) as info:
        load(str(broken))
    assert isinstance(info.value, ConfigError)
    assert not any(
        name.startswith("rlasync_plugin_broken_") for name in sys.modules
    )  # may be fixed and loaded again
    with pytest.raises(PluginError, match="no such file"):
        load(str(tmp_path / "absent.py"))
