"""The hosts file of ``rlasync launch --nodes hosts.txt``: one machine per line, the head first.

    # host          keys (all optional)
    10.0.0.1        roles=trainer gpus=8          # the head: the controller, and 8 trainer ranks
    gpu-node-2      roles=engine  engines=8 addr=10.0.0.2
    fd00::3         roles=engine,trainer          # IPv6 works as written (brackets optional)

``host`` is what the ``--via`` template starts a command on (``ssh {host}``); the node listens
at ``addr`` (default: ``host``) on ``port`` (default ``launch.port``). Roles place the run:
``engine`` puts ``engines`` replicas there (default ``gpus``, else 1), ``trainer`` puts
``trainer_ranks`` ranks there (default ``gpus``, else 1); with no ``roles`` on any line, the
config's ``cluster`` section places them. ``python`` is the interpreter to run there (default:
the launcher's own path, as on machines that share a file system).
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from pathlib import Path
from typing import Literal

import msgspec

from ..config import Config, ConfigError
from ..runtime.address import tcp_address

Role = Literal["engine", "trainer"]
ROLES: tuple[Role, ...] = ("engine", "trainer")
_COUNTS = ("gpus", "engines", "trainer_ranks", "port")
_TEXT = ("addr", "python")
_KEYS = (*_COUNTS, *_TEXT, "roles")
_HOSTNAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")


class HostsFileError(ConfigError):
    """A line of the hosts file is wrong; the message names the file, the line and the fix."""


class Host(msgspec.Struct, frozen=True, kw_only=True):
    """One machine of a launch."""

    host: str
    """Where the ``--via`` template runs commands (``ssh {host}``, ``ip netns exec {host}``)."""
    addr: str
    """The address other nodes reach this one at (an IPv4 or IPv6 literal, or a host name)."""
    port: int = 0
    """The TCP port this node listens on; 0: ``launch.port`` (+ the host's index among the
    lines that share its address, so several nodes can run on one machine)."""
    roles: tuple[Role, ...] = ()
    gpus: int = 0
    engines: int = 0
    trainer_ranks: int = 0
    python: str = ""
    line: int = 0

    def listen(self, port: int) -> str:
        """``tcp://addr:port``, with IPv6 literals in brackets."""
        return tcp_address(self.addr, port)

    @property
    def engine_count(self) -> int:
        return (self.engines or self.gpus or 1) if "engine" in self.roles else 0

    @property
    def trainer_count(self) -> int:
        return (self.trainer_ranks or self.gpus or 1) if "trainer" in self.roles else 0


def parse_hosts(text: str, source: str = "hosts file") -> list[Host]:
    """The hosts of a hosts file's text; ``HostsFileError`` names the line of any mistake."""
    hosts: list[Host] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        words = shlex.split(raw, comments=True)
        if not words:
            continue
        where = f"{source}:{number}"
        hosts.append(_parse_line(words, where, number))
    if not hosts:
        raise HostsFileError(
            f"{source}: no hosts; write one machine per line, the head first (e.g. `10.0.0.1 roles=trainer`)"
        )
    seen: dict[tuple[str, int], int] = {}
    for host in hosts:
        if host.port:
            other = seen.setdefault((host.addr, host.port), host.line)
            if other != host.line:
                raise HostsFileError(
                    f"{source}:{host.line}: {host.addr} port {host.port} is also on line {other}; give each node on one machine its own port="
                )
    return hosts


def read_hosts(path: str | Path) -> list[Host]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise HostsFileError(f"cannot read the hosts file {path}: {exc.strerror}") from None
    return parse_hosts(text, str(path))


def _parse_line(words: list[str], where: str, number: int) -> Host:
    name, *pairs = words
    if "=" in name:
        raise HostsFileError(
            f"{where}: a line starts with the host, then key=value pairs; got {name!r} first"
        )
    host = _address(name.strip("[]"), where, "host")
    fields: dict[str, object] = {"host": host, "addr": host, "line": number}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not value:
            raise HostsFileError(f"{where}: {pair!r} is not key=value (keys: {', '.join(_KEYS)})")
        if key not in _KEYS:
            raise HostsFileError(f"{where}: unknown key {key!r}; the keys are {', '.join(_KEYS)}")
        if key in fields and key not in ("host", "addr", "line"):
            raise HostsFileError(f"{where}: {key} is given twice")
        if key in _COUNTS:
            if not value.isdigit() or (key == "port" and not 0 < int(value) < 65536):
                raise HostsFileError(
                    f"{where}: {key}={value!r} must be a whole number"
                    + (" from 1 to 65535" if key == "port" else "")
                )
            fields[key] = int(value)
        elif key == "roles":
            roles = tuple(r for r in value.split(",") if r)
            wrong = [r for r in roles if r not in ROLES]
            if wrong:
                raise HostsFileError(
                    f"{where}: unknown role {wrong[0]!r}; roles are {', '.join(ROLES)} (comma-separated)"
                )
            fields[key] = tuple(dict.fromkeys(roles))
        elif key == "addr":
            fields[key] = _address(value.strip("[]"), where, "addr")
        else:
            fields[key] = value
    return msgspec.convert(fields, Host)


def _address(value: str, where: str, key: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        pass
    if not _HOSTNAME.fullmatch(value):
        raise HostsFileError(f"{where}: {key} {value!r} is neither an IP address nor a host name")
    return value


class HostRoles(msgspec.Struct, frozen=True, kw_only=True):
    """Where the hosts file's roles place the run: the ``cluster`` section it replaces."""

    engines: list[int]
    """The node (host line, the head 0) of each engine replica."""
    trainer: list[int]
    """The node of each trainer rank, in rank order."""

    def apply(self, config: Config) -> Config:
        """``config`` placed by these roles: its engines and trainer ranks on these nodes (no
        ``engines_per_node``), and as many trainer ranks as they place."""
        cluster = msgspec.structs.replace(
            config.cluster, engines=list(self.engines), engines_per_node=0, trainer=list(self.trainer)
        )
        trainer = msgspec.structs.replace(config.trainer, world_size=len(self.trainer))
        return msgspec.structs.replace(config, cluster=cluster, trainer=trainer)


def host_roles(hosts: list[Host]) -> HostRoles | None:
    """The placement the hosts' roles make; None when no host names roles (the config's
    ``cluster`` section places the run)."""
    if not any(h.roles for h in hosts):
        return None
    engines = [rank for rank, h in enumerate(hosts) for _ in range(h.engine_count)]
    trainer = [rank for rank, h in enumerate(hosts) for _ in range(h.trainer_count)]
    if not engines or not trainer:
        missing = "engine" if not engines else "trainer"
        raise HostsFileError(
            f"no host has the {missing} role: add roles={missing} to a line (a run needs both roles somewhere)"
        )
    return HostRoles(engines=engines, trainer=trainer)


def listen_addresses(hosts: list[Host], base_port: int) -> list[str]:
    """Where each host's node listens: its ``port``, or ``base_port`` plus its index among the
    hosts that share its address."""
    count: dict[str, int] = {}
    addresses = []
    for h in hosts:
        index = count.get(h.addr, 0)
        count[h.addr] = index + 1
        addresses.append(h.listen(h.port or base_port + index))
    return addresses
