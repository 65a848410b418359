from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from rlasync.cli import app
from rlasync.cli.common import bare_resume, parse_resume
from rlasync.compose.checkpoints import resuming
from rlasync.config import load_config


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


def test_resume_takes_no_value_or_auto() -> None:
    """``--resume`` alone (``rlasync.__main__`` spells it ``--resume=newest``: Typer cannot leave
    an option's value optional) and ``--resume=auto``; anything else is an error naming both."""
    assert bare_resume(["train", "c.yaml", "--resume", "x=1", "--resume=auto"]) == [
        "train",
        "c.yaml",
        "--resume=newest",
        "x=1",
        "--resume=auto",
    ]
    assert [parse_resume(v, "rlasync train") for v in ("", "newest", "auto")] == [False, True, "auto"]
    for command in (
        ["train", "configs/quickstart.yaml"],
        ["launch", "configs/quickstart.yaml", "--from-env"],
    ):
        result = CliRunner(env={"COLUMNS": "300"}).invoke(app, [*command, "--resume=sometimes"])
        assert result.exit_code == 2 and "--resume takes no value, or =auto" in result.output, result.output


def test_resume_auto_resumes_only_when_a_checkpoint_is_there(tmp_path: Path) -> None:
    config = load_config(
        Path(__file__).parents[2] / "configs" / "quickstart.yaml", [f"train.run_dir={tmp_path}"]
    )
    assert resuming(config, "auto") is False and resuming(config, True) and not resuming(config, False)
    step = tmp_path / "checkpoints" / "step_000004"
    step.mkdir(parents=True)
    (step / "state.json").write_text("{}")  # a complete one (a torn one would be named by the resume)
    assert resuming(config, "auto") is True
    (tmp_path / "checkpoints" / "step_000006.partial").mkdir()  # one being written does not count
    assert resuming(config, "auto") is True
