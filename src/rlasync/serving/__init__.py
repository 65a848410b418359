"""An OpenAI-compatible endpoint that records the tokens of every call, and the ``openai`` loop
that trains agents written against the OpenAI API through it.

    async with Endpoint(router, tokenizer, EndpointConfig(port=8000), model_name="policy") as endpoint:
        ...  # openai.AsyncOpenAI(base_url=endpoint.url + "/v1", api_key="-")

``rlasync serve MODEL_DIR`` (or ``rlasync serve CONFIG``: the model its run starts from) starts
one for chat and evaluation; a run whose rows use the ``openai`` loop (``agent.default_loop:
openai``, ``agent.openai_agent: module:function``) starts one on each agent-loop worker.
"""

from .endpoint import Endpoint
from .loop import AgentCallError, EnvironmentLoop, OpenAIAgentLoop, load_agent
from .recording import Call, Recording, samples, trajectory_of
from .schema import APIError
from .server import EndpointError

__all__ = [
    "APIError",
    "AgentCallError",
    "Call",
    "Endpoint",
    "EndpointError",
    "EnvironmentLoop",
    "OpenAIAgentLoop",
    "Recording",
    "load_agent",
    "samples",
    "trajectory_of",
]
