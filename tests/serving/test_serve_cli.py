"""``rlasync serve MODEL_DIR``: the endpoint alone, for chat and evaluation, stopped by Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest


@pytest.mark.timeout(120)
def test_serve_answers_the_openai_client_and_stops_on_ctrl_c(nano_model_dir: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "rlasync",
        "serve",
        str(nano_model_dir),
        "--port",
        "0",
        "--api-key",
        "secret-1",
    ]
    serving = subprocess.Popen(
        command, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
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
        client = openai.OpenAI(base_url=url + "/v1", api_key="secret-1", max_retries=0)
        (model,) = client.models.list().data
        assert model.id == nano_model_dir.name
        reply = client.chat.completions.create(
            model=model.id, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
        )
        assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 4
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        serving.send_signal(signal.SIGINT)
        assert serving.wait(timeout=30) == 0
    finally:
        if serving.poll() is None:
            serving.kill()
            serving.wait()


def test_serve_refuses_a_folder_that_is_not_a_model(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rlasync", "serve", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "not a model folder" in done.stderr
