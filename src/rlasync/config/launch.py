"""How ``rlasync launch`` starts a run's nodes (``launch.*``): command template, ports, deadlines."""

from __future__ import annotations

from typing import Annotated

import msgspec

PositiveSeconds = Annotated[float, msgspec.Meta(gt=0)]


class LaunchConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """``rlasync launch --nodes hosts.txt`` (and ``--from-env`` under torchrun or Slurm)."""

    via: str = "ssh {host}"
    """The command that runs a command on a host: ``{host}`` is the hosts file's first word.
    The node's command follows it as words (``ip netns exec {host}``, ``docker exec -i {host}``),
    as one quoted word for ``ssh`` (its remote shell splits it), or where ``{command}`` stands
    (``sh -c {command}``). ``ssh`` gets ``-o BatchMode=yes``: a host that wants a password is an
    error, never a prompt. The cluster secret goes to the command's stdin, never its arguments."""

    python: str = ""
    """The interpreter on the hosts (a host's ``python=`` wins); empty: the launcher's own path,
    as on machines that share a file system or an image."""

    port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 29600
    """The TCP port nodes listen on (a host's ``port=`` wins; several nodes on one address take
    the next ports)."""

    start_timeout_s: PositiveSeconds = 300.0
    """How long every host may take to start its node and join the head (the head's warm-start,
    when ``train.model_dir`` is empty, counts). Past it the launch stops everything and names
    the hosts that did not join, with their last lines of output."""

    stop_timeout_s: PositiveSeconds = 20.0
    """How long nodes may take to stop (told through their stdin, then SIGTERM) before the
    launcher kills what is left."""
