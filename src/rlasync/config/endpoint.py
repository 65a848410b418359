"""Settings of the OpenAI-compatible HTTP endpoint (``agent.endpoint.*``; ``rlasync serve``)."""

from __future__ import annotations

from typing import Annotated

import msgspec

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


TRAIN_HEADER = "x-rlasync-train"
"""``false`` on a call to a recording endpoint: the policy answers it, but it is not part of the
trajectory (``Recording.aside``): a game's other seats played by the policy, an agent's helper
calls. (Here, below the serving layer, so an environment can name it.)"""


class EndpointConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Where the endpoint listens and what it admits (``rlasync.serving``).

    In a run each agent-loop worker that rolls out ``openai`` trajectories starts one on its
    node, on loopback: the agents it runs call it. ``rlasync serve`` starts one for chat and
    evaluation."""

    host: str = "127.0.0.1"
    """The address to listen on. Loopback by default: nothing outside the machine reaches it."""
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """0: a free port, chosen when it starts (what a run wants: agents are told the address)."""
    served_model_name: str = ""
    """The ``model`` clients name (``/v1/models`` lists it); "": the model folder's name. In a
    run any name is taken: there is one policy, and the agent's code is not edited for it."""
    api_key: str = ""
    """``rlasync serve``: when set, requests must carry it (``Authorization: Bearer …``). In a
    run each trajectory's key is made for it, and only keys of trajectories in progress pass."""
    max_request_bytes: PositiveInt = 1 << 20
    """A request body larger than this is refused (413) before it is read whole."""
    max_concurrent_requests: PositiveInt = 1024
    """Requests in progress at once; one more is refused (429: OpenAI clients retry it)."""
    request_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0
    """Deadline of one request inside the endpoint, its generation included (504 after it)."""
    default_max_tokens: PositiveInt = 256
    """New tokens of a request that names no ``max_tokens`` (``rlasync serve``; in a run the
    run's ``train.max_new_tokens``)."""
    max_n: Annotated[int, msgspec.Meta(ge=1, le=128)] = 16
    """The largest ``n`` (choices of one request) taken."""
    stored_responses: Annotated[int, msgspec.Meta(ge=0)] = 1024
    """``/v1/responses``: the conversations of this many latest responses are kept in memory
    (``store`` not false), so a request can go on from one by ``previous_response_id``; an older
    one is a 400 naming it. 0: none kept."""
