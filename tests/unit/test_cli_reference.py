"""The command-line reference (``docs/reference/cli.md``) is typer's rendering of the app as it is
now, and lists every command and every option of each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import typer.main

from rlasync.cli import app

PAGE = Path(__file__).parents[2] / "docs" / "reference" / "cli.md"
REGENERATE = (
    'typer rlasync.cli utils docs --name rlasync --title "Command line" --output docs/reference/cli.md'
)


def test_the_cli_page_is_the_app_as_it_is() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "typer",
            "rlasync.cli",
            "utils",
            "docs",
            "--name",
            "rlasync",
            "--title",
            "Command line",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == PAGE.read_text().strip(), (
        f"docs/reference/cli.md is stale: run `{REGENERATE}`"
    )


def test_the_cli_page_lists_every_command_and_option() -> None:
    page = PAGE.read_text()
    group = typer.main.get_command(app)
    assert hasattr(group, "commands"), group  # typer's own click group (typer vendors click)
    missing = []
    for name, command in group.commands.items():
        if f"## `rlasync {name}`" not in page:
            missing.append(f"rlasync {name}")
        section = page.split(f"## `rlasync {name}`", 1)[-1].split("\n## ", 1)[0]
        for parameter in command.params:
            if (
                parameter.param_type_name == "option"
                and not parameter.hidden
                and not any(f"`{opt}" in section for opt in parameter.opts)
            ):
                missing.append(f"rlasync {name} {parameter.opts[0]}")
    assert not missing, f"not on docs/reference/cli.md: {missing}"
