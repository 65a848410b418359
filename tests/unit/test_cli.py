from __future__ import annotations

import os
import subprocess
import sys

from typer.testing import CliRunner

from rlasync.cli import app


def test_help_lists_commands_and_imports_no_torch() -> None:
    code = "import sys; from rlasync.cli import app; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0 and "node" in result.output


def test_help_reads_as_clean_paragraphs() -> None:
    runner = CliRunner(env={"COLUMNS": "100"})
    for command in ([], ["train"], ["launch"], ["node"], ["status"]):
        result = runner.invoke(app, [*command, "--help"])
        assert result.exit_code == 0
        assert "``" not in result.output and ":class:" not in result.output, result.output
    # A docstring's hard line breaks are not kept: on a wide terminal each summary is one line.
    listing = CliRunner(env={"COLUMNS": "400"}).invoke(app, ["--help"]).output
    for command in app.registered_commands:
        summary = " ".join((command.callback.__doc__ or "").split("\n\n")[0].split()).replace("`", "")
        assert any(summary in line for line in listing.splitlines()), (summary, listing)


def test_node_rejects_a_bad_override_naming_the_path() -> None:
    result = CliRunner().invoke(
        app, ["node", "--rank", "0", "--listen", "ipc:///tmp/x.sock", "--set", "runtime.node_dead_after_s=-2"]
    )
    assert result.exit_code != 0
    assert "runtime.node_dead_after_s" in result.output


def test_tcp_node_needs_a_secret() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RLASYNC_CLUSTER_SECRET"}
    result = CliRunner(env=env).invoke(app, ["node", "--rank", "0", "--listen", "tcp://127.0.0.1:0"])
    assert result.exit_code != 0 and "RLASYNC_CLUSTER_SECRET" in result.output


def test_secret_prints_a_usable_secret() -> None:
    result = CliRunner().invoke(app, ["secret"])
    assert result.exit_code == 0 and len(result.output.strip()) == 64
