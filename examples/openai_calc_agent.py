"""An agent written as plain OpenAI-client code: the calculator task, tool call by tool call.

rlasync trains it unchanged (``agent.default_loop: openai``, ``agent.openai_agent:
examples/openai_calc_agent.py:solve``): the run hands ``solve`` an ``openai.AsyncOpenAI`` whose
calls reach the policy being trained, and records their tokens. Any agent framework that takes
a ``base_url`` and an ``api_key`` works the same way.
"""

from __future__ import annotations

import json
from typing import Any

from openai import AsyncOpenAI

from rlasync.tools.calculator import calculator  # the environment: integer arithmetic

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


async def solve(client: AsyncOpenAI, row: dict[str, Any]) -> float | None:
    """Ask, run each calculator call the model makes, send the results back; at most three
    replies. None: the run's reward scores the final answer (the calc task's own)."""
    messages: list[dict[str, Any]] = list(row["messages"])
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments)["expression"]
                result = calculator(str(expression))
            except (ValueError, KeyError, TypeError):
                result = 'error: the call\'s arguments are not {"expression": ...}'
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
