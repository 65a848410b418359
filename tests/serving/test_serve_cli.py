"""``rlasync serve MODEL_DIR`` or ``rlasync serve CONFIG`` (the model its run starts from): the
endpoint alone, for chat and evaluation, stopped by Ctrl-C. The docs' line runs as written."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).parents[2]


@contextlib.contextmanager
def _serving(*args: str) -> Iterator[str]:
    """A real ``rlasync serve ARGS`` process; its URL once it listens. Ctrl-C stops it, and it
    must exit 0."""
    serving = subprocess.Popen(
        [sys.executable, "-m", "rlasync", "serve", *args],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        url = None
        deadline = time.monotonic() + 60
        assert serving.stderr is not None
        while url is None and time.monotonic() < deadline:
            line = serving.stderr.readline()
            if not line:
                break
            found = re.search(r"at (http://\S+)/v1", line)
            url = found.group(1) if found else None
        assert url, "rlasync serve did not say where it listens"
        yield url
        serving.send_signal(signal.SIGINT)
        assert serving.wait(timeout=30) == 0
    finally:
        if serving.poll() is None:
            serving.kill()
            serving.wait()


@pytest.mark.timeout(120)
def test_serve_answers_the_openai_client_and_stops_on_ctrl_c(nano_model_dir: Path) -> None:
    with _serving(str(nano_model_dir), "--port", "0", "--api-key", "secret-1") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="secret-1", max_retries=0)
        (model,) = client.models.list().data
        assert model.id == nano_model_dir.name
        reply = client.chat.completions.create(
            model=model.id, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
        )
        assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 4
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()


@pytest.mark.timeout(180)  # the warm-start, when no test before built it: about 15 s
def test_the_documented_serve_line_serves_the_quickstart_model(reverse_model: Path) -> None:
    """The ``rlasync serve`` line of the OpenAI endpoint's page (docs/openai.md), with a free port,
    and the warm-start cache of this test run instead of ``runs/quickstart``: seed 4 with the
    quickstart's settings, which the ``reverse_model`` fixture warm-started there (a clone with no
    run finds no cache and warm-starts seed 2 in ``runs/quickstart`` the same way)."""
    (line,) = [
        line
        for line in (ROOT / "docs" / "openai.md").read_text().splitlines()
        if line.startswith("rlasync serve ")
    ]
    args = shlex.split(line, comments=True)[2:]
    assert "--port" in args, line
    args[args.index("--port") + 1] = "0"
    with _serving(*args, f"train.run_dir={reverse_model.parent.parent}", "train.seed=4") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        (model,) = client.models.list().data
        assert model.id == reverse_model.name  # the warm-started model, found in the cache
        reply = client.chat.completions.create(
            model=model.id,
            messages=[{"role": "user", "content": "Reverse: abc"}],
            max_tokens=8,
            temperature=0,
        )
        assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 8


@pytest.mark.parametrize(
    "args",
    [
        ["{tmp}"],  # a folder with no model in it
        ["runs/none/warmstart/reverse-nano-seed2-*/"],  # a shell glob that matched nothing
        ["{tmp}", "train.seed=4"],  # overrides without a config
    ],
)
def test_serve_refuses_what_is_not_a_model_naming_what_to_pass(tmp_path: Path, args: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rlasync", "serve", *(a.format(tmp=tmp_path) for a in args)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    (message,) = done.stderr.splitlines()  # one line
    assert message.startswith("rlasync serve: ") and ("YAML config" in message), message
