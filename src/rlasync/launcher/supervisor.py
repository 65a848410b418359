"""``rlasync launch --nodes hosts.txt``: start a node on every host, relay their output, stop them all.

    launch = Launch(read_hosts("hosts.txt"), load_config("configs/quickstart_cluster.yaml"))
    code = await launch.run()    # the head's exit code; 1 if a node failed, 130 on Ctrl-C

Each host runs ``python -m rlasync launch --from-stdin`` through the ``--via`` template (``ssh
{host}`` by default), in a process group of its own, and gets its ticket (rank, addresses, the
secret, the config) on stdin. The first host is the head: it runs the controller and the others
join it. Every line a host prints comes back prefixed with its name; the last lines are kept
for errors. Milestones (``runtime.events``) say when each node joined.

Starting: every host must join within ``launch.start_timeout_s``; a host whose process ends
first (ssh refused, no such python, port in use, another rlasync version) or that does not
join in time stops the launch with an error naming it and quoting its last lines.
Running: the run ends when the head's process ends; a node that fails (exits non-zero), Ctrl-C
or SIGTERM stops every host. Stopping: the head's stdin closes first (it stops the run and
tells the nodes; with ``train.checkpoint_on_interrupt`` it has the run's grace to save one),
then the others', then SIGTERM and, after ``launch.stop_timeout_s``, SIGKILL
to each process group: nothing is left running.
"""

from __future__ import annotations

import asyncio
import collections
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from ..config import Config, ConfigError
from ..interrupts import HARD_STOP_AFTER_S
from ..runtime.events import parse
from ..runtime.joining import EX_ENDED_EARLY
from ..runtime.types import VERSION
from .hosts import Host, listen_addresses
from .ticket import Ticket

LAST_LINES = 15


class LaunchError(ConfigError):
    """A host could not start, or the launch could not go on; the message names the host."""


def remote_command(via: str, host: str, argv: list[str]) -> list[str]:
    """The local command that runs ``argv`` on ``host`` through the ``via`` template."""
    words = shlex.split(via)
    if not words:
        raise LaunchError("launch.via is empty: give a command template such as 'ssh {host}'")
    if any("{command}" in w for w in words):
        return [w.replace("{host}", host).replace("{command}", shlex.join(argv)) for w in words]
    words = [w.replace("{host}", host) for w in words]
    if os.path.basename(words[0]) == "ssh":
        if not any("BatchMode" in w for w in words):
            words[1:1] = ["-o", "BatchMode=yes"]  # a host that wants a password is an error, not a prompt
        return [*words, shlex.join(argv)]  # ssh hands its remote shell one string
    return [*words, *argv]


class HostProcess:
    """One host's process: its output, milestones and last lines."""

    def __init__(self, host: Host, label: str, ticket: Ticket, command: list[str]) -> None:
        self.host, self.label, self.ticket, self.command = host, label, ticket, command
        self.node_id = f"node-{ticket.rank}"
        self.proc: asyncio.subprocess.Process
        self.last: collections.deque[str] = collections.deque(maxlen=LAST_LINES)
        self.events: dict[str, dict[str, Any]] = {}
        self.changed = asyncio.Event()
        self.relay: asyncio.Task[None]

    @property
    def started(self) -> bool:
        """The head has every node joined; a node has joined."""
        return ("ready" if self.ticket.rank == 0 else "joined") in self.events

    @property
    def ended(self) -> bool:
        """Its process ended and all its output was read."""
        return self.relay.done()

    def tail(self) -> str:
        return "\n".join(f"    {line}" for line in self.last) or "    (it printed nothing)"


class Launch:
    """The nodes of one run on ``hosts`` (the head first), started, relayed and stopped together."""

    def __init__(
        self,
        hosts: list[Host],
        config: Config,
        *,
        secret: str,
        resume: bool | Literal["auto"] = False,
        write: Callable[[str], None] | None = None,
    ) -> None:
        if not hosts:
            raise LaunchError("no hosts to launch on")
        self.hosts, self.config, self.secret, self.resume = hosts, config, secret, resume
        self.launch = config.launch
        self.write = write or (lambda line: print(line, flush=True))
        self.processes: list[HostProcess] = []
        self.started_at = 0.0
        self.ready_s: dict[str, float] = {}  # milestone -> seconds after the launch began (first seen)
        self._stopping = asyncio.Event()
        self._interrupted = 0

    # -- start --------------------------------------------------------------------------------
    def _plan(self) -> list[HostProcess]:
        addresses = listen_addresses(self.hosts, self.launch.port)
        head = addresses[0]
        labels = [h.host for h in self.hosts]
        if len(set(labels)) < len(labels):  # several nodes on one machine: tell them apart by address
            labels = [f"{h.host}/{a.rsplit(':', 1)[1]}" for h, a in zip(self.hosts, addresses)]
        config = msgspec.structs.replace(
            self.config,
            cluster=msgspec.structs.replace(
                self.config.cluster, start="external", listen=head, nodes=len(self.hosts)
            ),
            # a node waits for the head as long as the launch waits for it (a head warm-starting)
            runtime=msgspec.structs.replace(
                self.config.runtime,
                join_timeout_s=max(self.config.runtime.join_timeout_s, self.launch.start_timeout_s),
            ),
        )
        tree = msgspec.to_builtins(config)
        planned = []
        for rank, (host, listen, label) in enumerate(zip(self.hosts, addresses, labels)):
            ticket = Ticket(
                host=label,
                rank=rank,
                nodes=len(self.hosts),
                head=head,
                listen=listen,
                secret=self.secret,
                version=VERSION,
                config=tree,
                resume=self.resume if rank == 0 else False,
            )
            python = host.python or self.launch.python or sys.executable
            argv = [python, "-m", "rlasync", "launch", "--from-stdin"]
            planned.append(HostProcess(host, label, ticket, remote_command(self.launch.via, host.host, argv)))
        return planned

    async def _spawn(self, hp: HostProcess) -> None:
        try:
            hp.proc = await asyncio.create_subprocess_exec(
                *hp.command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches the launcher, which stops every host in order
            )
        except OSError as exc:
            raise LaunchError(
                f"{hp.label}: cannot run {shlex.join(hp.command[:3])}…: {exc.strerror} (check launch.via)"
            ) from None
        assert hp.proc.stdin is not None
        try:
            hp.proc.stdin.write(msgspec.json.encode(hp.ticket) + b"\n")
        except (BrokenPipeError, ConnectionResetError, RuntimeError):
            # The host's command ended before it read its ticket (ssh refused, no such python):
            # its pipe is closed (uvloop raises RuntimeError for that). Its exit code and last
            # lines, relayed below, say why; _wait_started names it.
            pass
        hp.relay = asyncio.ensure_future(self._relay(hp))

    async def _relay(self, hp: HostProcess) -> None:
        assert hp.proc.stdout is not None
        width = max(len(p.label) for p in self.processes)
        while True:
            try:
                raw = await hp.proc.stdout.readline()
            except (
                ValueError,
                asyncio.LimitOverrunError,
            ):  # a line past the stream's limit: read it in parts
                raw = await hp.proc.stdout.read(65536)
            if not raw:
                break
            line = raw.decode(errors="replace").rstrip("\n")
            event = parse(line)
            if event is not None:
                hp.events.setdefault(event["event"], event)
                if event["event"] not in self.ready_s:
                    self.ready_s[event["event"]] = took = time.perf_counter() - self.started_at
                    if event["event"] == "trainer":
                        self.write(
                            f"launch: the trainer's {event.get('ranks')} rank(s) did their first collective {took:.1f} s after the launch began"
                        )
                hp.changed.set()
                continue
            hp.last.append(line)
            self.write(f"{hp.label:<{width}} | {line}")
        await hp.proc.wait()
        hp.changed.set()

    async def _wait_started(self) -> None:
        """Every node joined and the head has them all, or ``LaunchError`` naming who did not."""
        deadline = self.started_at + self.launch.start_timeout_s
        while True:
            for hp in self.processes:
                hp.changed.clear()  # before looking: a change from now on wakes the wait below
            failed = [hp for hp in self.processes if hp.ended and not hp.started]
            if failed:
                hp = failed[0]
                raise LaunchError(
                    f"{hp.label} ({hp.node_id}) stopped with exit code {hp.proc.returncode} before it joined the run; its last lines:\n{hp.tail()}"
                )
            if all(hp.started for hp in self.processes):
                return
            left = deadline - time.perf_counter()
            if left <= 0 or self._stopping.is_set():
                break
            waits = [asyncio.ensure_future(hp.changed.wait()) for hp in self.processes] + [
                asyncio.ensure_future(self._stopping.wait())
            ]
            await asyncio.wait(waits, timeout=min(left, 1.0), return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
        if self._stopping.is_set():
            raise KeyboardInterrupt
        late = [hp for hp in self.processes if not hp.started]
        named = "\n".join(f"  {hp.label} ({hp.node_id}); its last lines:\n{hp.tail()}" for hp in late)
        raise LaunchError(
            f"not started within launch.start_timeout_s={self.launch.start_timeout_s:g}s:\n{named}"
        )

    # -- run ----------------------------------------------------------------------------------
    async def run(self) -> int:
        """Start every host, relay until the head ends (or a node fails, or Ctrl-C), stop all.
        Returns the launch's exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)
        self.started_at = time.perf_counter()
        self.processes = self._plan()
        try:
            for hp in self.processes:
                await self._spawn(hp)
            await self._wait_started()
            self.write(
                f"launch: {len(self.processes)} nodes started in {time.perf_counter() - self.started_at:.1f} s"
            )
            return await self._supervise()
        except KeyboardInterrupt:
            return 130
        finally:
            await self.stop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def _on_signal(self) -> None:
        self._interrupted += 1
        self._stopping.set()
        if self._interrupted > 1:  # a second Ctrl-C: no more patience
            for hp in self.processes:
                _kill_group(hp, signal.SIGKILL)

    async def _supervise(self) -> int:
        head = self.processes[0]
        exits: dict[asyncio.Future[Any], HostProcess] = {
            hp.relay: hp for hp in self.processes
        }  # a relay ends when its process did and its output is read
        stop: asyncio.Future[Any] = asyncio.ensure_future(self._stopping.wait())
        try:
            while True:
                done, _ = await asyncio.wait([*exits, stop], return_when=asyncio.FIRST_COMPLETED)
                if stop in done:
                    self.write("launch: interrupted; stopping every host")
                    return 130
                for waiter in done:
                    hp = exits.pop(waiter)
                    if hp is head:
                        return hp.proc.returncode or 0
                    if hp.proc.returncode and hp.proc.returncode != EX_ENDED_EARLY:  # not the head's doing
                        self.write(
                            f"launch: {hp.label} ({hp.node_id}) failed with exit code {hp.proc.returncode}; stopping every host. Its last lines:\n{hp.tail()}"
                        )
                        return 1
        finally:
            stop.cancel()

    # -- stop ---------------------------------------------------------------------------------
    async def stop(self) -> None:
        """Stop every host: the head's stdin closes first (it ends the run and tells the nodes),
        then the others', then SIGTERM, and SIGKILL after ``launch.stop_timeout_s``."""
        spawned = [hp for hp in self.processes if hasattr(hp, "proc")]
        budget = self.launch.stop_timeout_s
        train = self.config.train
        # The head may first finish its step and save a checkpoint (rlasync.interrupts' deadline).
        head_s = max(
            budget / 2, train.interrupt_grace_s + HARD_STOP_AFTER_S if train.checkpoint_on_interrupt else 0
        )
        steps: list[tuple[Callable[[HostProcess], None], float]] = [
            (lambda hp: _close_stdin(hp) if hp.ticket.rank == 0 else None, head_s),
            (_close_stdin, budget / 4),
            (lambda hp: _kill_group(hp, signal.SIGTERM), budget / 4),
            (lambda hp: _kill_group(hp, signal.SIGKILL), 5.0),
        ]
        for act, wait in steps:
            running = [hp for hp in spawned if hp.proc.returncode is None]
            if not running:
                break
            for hp in running:
                act(hp)
            await asyncio.wait([asyncio.ensure_future(hp.proc.wait()) for hp in running], timeout=wait)
        for hp in spawned:
            _kill_group(hp, signal.SIGKILL)  # anything the host's command left in its group (ssh's helpers)
        relays = [hp.relay for hp in spawned if hasattr(hp, "relay")]
        if relays:
            await asyncio.wait(relays, timeout=5.0)


def _close_stdin(hp: HostProcess) -> None:
    if hp.proc.stdin is not None and not hp.proc.stdin.is_closing():
        hp.proc.stdin.close()


def _kill_group(hp: HostProcess, sig: signal.Signals) -> None:
    try:
        os.killpg(hp.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
