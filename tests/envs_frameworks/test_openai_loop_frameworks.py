"""A LangChain agent, as its author wrote it (a structured answer, rewarded when right), trains
through the ``openai`` loop: its calls, structured by the engine's grammar, are the trajectory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("langchain_openai", reason="needs langchain-openai: the envs tier, `make test-envs`")

from frameworks import run_yaml  # noqa: E402

LANGCHAIN_AGENT = '''\
"""A LangChain agent, as its author wrote it: a structured answer, rewarded when it is right."""
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field


class Answer(BaseModel):
    answer: str = Field(max_length=8)


async def solve(client, row):
    chat = ChatOpenAI(model="policy", base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
    structured = chat.with_structured_output(Answer, method="json_schema")
    out = await structured.ainvoke(row["messages"])
    return float(out.answer == row["ground_truth"])
'''


@pytest.mark.timeout(600)
def test_a_langchain_agent_trains_through_the_openai_loop(tmp_path: Path, nano_model_dir: Path) -> None:
    (tmp_path / "lc_agent.py").write_text(LANGCHAIN_AGENT)
    rows = "".join(
        json.dumps({"prompt": f"Reverse {w}", "ground_truth": w[::-1]}) + "\n"
        for w in ["abc", "dog", "moon", "tree"]
    )
    (tmp_path / "rows.jsonl").write_text(rows)
    source = (
        "data:\n  train_files: [rows.jsonl]\n  val_files: [rows.jsonl]\n"
        "agent:\n  default_loop: openai\n  openai_agent: ./lc_agent.py:solve\n"
    )
    run = run_yaml(tmp_path, source, model=nano_model_dir, mode="sync", tokens=32)
    assert all(0.0 <= r["reward"] <= 1.0 and r.get("reward/errors", 0) == 0 for r in run["steps"])
    for trace in run["traces"]:  # every reply the agent trained on is the structured answer it parsed
        assert set(json.loads(trace["messages"][-1]["content"])) == {"answer"}, trace
