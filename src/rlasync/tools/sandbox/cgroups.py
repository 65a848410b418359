"""The sandbox's cgroup layer: one cgroup per run, its limits, its statistics, killing what is in it.

``find_cgroups()`` says where this process may create cgroups (v2, or the v1 ``memory`` and
``pids`` hierarchies); ``Cgroups.create`` makes one per run with a memory limit for all its
processes together (swap included) and a process limit; ``RunCgroup`` reads whether the run hit
them, kills every process still in it, and removes it. A program joins a run's cgroup before its
first instruction through ``RunCgroup.join_argv`` (a tiny ``sh`` wrapper joins, then execs it,
so every descendant is inside).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import signal
import time

logger = logging.getLogger(__name__)

# Joins the cgroup(s) named before "--" (its own pid: the exec keeps it), then execs the rest.
_JOIN_CGROUP = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
_CGROUP_PREFIX = "rlasync-python-"
REAP_TIMEOUT_S = 5.0
_run_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class Cgroups:
    """Where this process creates one cgroup per run."""

    version: int
    bases: tuple[str, ...]  # v1: (memory hierarchy dir, pids hierarchy dir); v2: (one dir,)

    def create(self, memory_bytes: int, max_processes: int, *, tag: str = "") -> RunCgroup:
        """A new cgroup with these limits, named for this process (``tag``: e.g. ``probe-``)."""
        name = f"{_CGROUP_PREFIX}{os.getpid()}-{tag}{next(_run_ids)}"
        dirs = tuple(os.path.join(base, name) for base in self.bases)
        made: list[str] = []
        try:
            for path in dirs:
                os.mkdir(path)
                made.append(path)
            if self.version == 1:
                memory, pids = dirs
                _write(os.path.join(memory, "memory.limit_in_bytes"), memory_bytes)
                if os.path.exists(os.path.join(memory, "memory.memsw.limit_in_bytes")):  # swap counted too
                    _write(os.path.join(memory, "memory.memsw.limit_in_bytes"), memory_bytes)
                _write(os.path.join(pids, "pids.max"), max_processes)
            else:
                (path,) = dirs
                _write(os.path.join(path, "memory.max"), memory_bytes)
                if os.path.exists(os.path.join(path, "memory.swap.max")):
                    _write(os.path.join(path, "memory.swap.max"), 0)
                _write(os.path.join(path, "pids.max"), max_processes)
        except BaseException:
            for path in reversed(made):
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            raise
        return RunCgroup(name, self.version, dirs)

    def remove_stale(self) -> None:
        """Remove empty cgroups left by a process of ours that died before its cleanup."""
        for base in self.bases:
            with contextlib.suppress(OSError):
                for entry in os.scandir(base):
                    owner = entry.name.removeprefix(_CGROUP_PREFIX).split("-")[0]
                    if entry.name.startswith(_CGROUP_PREFIX) and owner.isdigit() and not _alive(int(owner)):
                        with contextlib.suppress(OSError):
                            os.rmdir(entry.path)


@dataclasses.dataclass(frozen=True)
class RunCgroup:
    """The cgroup of one run (one directory per hierarchy)."""

    name: str
    version: int
    dirs: tuple[str, ...]

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(path, "cgroup.procs") for path in self.dirs]

    def join_argv(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this cgroup from its first instruction (exit status 125: could not join)."""
        return ["/bin/sh", "-c", _JOIN_CGROUP, "sh", *self.procs_files, "--", *argv]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for path in self.procs_files:
            with contextlib.suppress(OSError), open(path) as f:
                found.update(int(line) for line in f if line.strip())
        return found

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of this run at the memory limit."""
        memory = self.dirs[0]
        if self.version == 1:
            stats = _read_stats(os.path.join(memory, "memory.oom_control"))
            if "oom_kill" in stats:  # kernel >= 4.13
                return stats["oom_kill"] > 0 or stats.get("under_oom", 0) > 0
            return _read_stats(os.path.join(memory, "memory.failcnt"), single=True).get("", 0) > 0
        return _read_stats(os.path.join(memory, "memory.events")).get("oom_kill", 0) > 0

    def forks_refused(self) -> bool:
        """Whether a fork or thread start failed at the process limit."""
        return _read_stats(os.path.join(self.dirs[-1], "pids.events")).get("max", 0) > 0

    async def kill_all(self, timeout: float = REAP_TIMEOUT_S) -> bool:
        """SIGKILL every process in the cgroup until none is left (True), or until ``timeout``."""
        kill_file = os.path.join(self.dirs[0], "cgroup.kill")  # v2, Linux >= 5.14: the kernel does it
        use_kill_file = self.version == 2 and os.path.exists(kill_file)
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids()
            if not pids:
                return True
            if use_kill_file:
                with contextlib.suppress(OSError):
                    _write(kill_file, 1)
            else:
                for pid in pids:
                    self._kill(pid)
            if time.monotonic() > deadline:
                logger.warning(
                    "python tool: processes %s of cgroup %s did not exit %.0fs after SIGKILL",
                    sorted(pids),
                    self.name,
                    timeout,
                )
                return False
            await asyncio.sleep(0.005)

    def _kill(self, pid: int) -> None:
        # A pidfd pins the process: checked to be in this cgroup, then killed (no pid-reuse race).
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        except OSError:  # no pidfd (Linux < 5.3): the small race is the lesser evil
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            return
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                if self.name not in f.read():
                    return
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(fd)

    def remove(self) -> None:
        for path in self.dirs:
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                logger.warning("python tool: cannot remove cgroup %s: %s", path, e)


def find_cgroups() -> Cgroups:
    """The cgroup(s) of this process, v1 (memory and pids hierarchies) or v2, and where to create runs'.

    Raises:
        ValueError, OSError: no usable cgroup here (the message says why).
    """
    own: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(","):
                own[controller] = path
    v1: dict[str, str] = {}
    v2 = ""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            mount_root, mount_point, fstype, options = (
                fields[3],
                fields[4],
                fields[sep + 1],
                fields[sep + 3].split(","),
            )
            for controller in ("memory", "pids"):
                if fstype == "cgroup" and controller in options and controller in own:
                    v1[controller] = _under_mount(mount_point, mount_root, own[controller])
            if fstype == "cgroup2" and "" in own and not v2:
                v2 = _under_mount(mount_point, mount_root, own[""])
    if "memory" in v1 and "pids" in v1:
        return Cgroups(1, (v1["memory"], v1["pids"]))
    if v1:
        raise ValueError("the memory and pids controllers are on different cgroup versions")
    if not v2:
        raise ValueError("no cgroup file system is mounted")
    return _v2_cgroups(v2)


def _v2_cgroups(v2: str) -> Cgroups:
    """Where runs' cgroups go in the v2 hierarchy, below this process's cgroup ``v2`` or beside it."""
    wanted = {"memory", "pids"}
    if not wanted <= set(_read(os.path.join(v2, "cgroup.controllers")).split()):
        raise ValueError(f"the memory and pids controllers are not available in {v2}")
    if not wanted <= set(_read(os.path.join(v2, "cgroup.subtree_control")).split()):
        try:  # only where this cgroup holds no process itself (cgroup v2's "no internal processes")
            _write(os.path.join(v2, "cgroup.subtree_control"), "+memory +pids")
        except OSError:
            parent = os.path.dirname(v2)
            if os.path.exists(os.path.join(parent, "cgroup.procs")) and wanted <= set(
                _read(os.path.join(parent, "cgroup.subtree_control")).split()
            ):
                return Cgroups(2, (parent,))  # runs' cgroups are siblings of ours
            raise ValueError(
                f"cannot enable the memory and pids controllers below {v2} (it holds processes)"
            ) from None
    return Cgroups(2, (v2,))


def _under_mount(mount_point: str, mount_root: str, path: str) -> str:
    if mount_root != "/" and (path == mount_root or path.startswith(mount_root + "/")):
        path = path[len(mount_root) :] or "/"
    elif mount_root != "/":
        raise ValueError(f"this process's cgroup {path} is not under the mount of {mount_root}")
    return os.path.normpath(mount_point + "/" + path)


def _write(path: str, value: object) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _read_stats(path: str, *, single: bool = False) -> dict[str, int]:
    try:
        text = _read(path)
    except OSError:
        return {}
    if single:
        return {"": int(text.strip() or 0)}
    stats: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            stats[key] = int(value)
    return stats


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
