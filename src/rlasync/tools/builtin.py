"""The built-in ``python`` tool: a script in a sandbox (the ``calculator`` is in ``calculator.py``).

The python sandbox has to hold against the code it runs, also when rlasync itself runs as root
(CI, most containers). Layer by layer, and what each is for:

- **namespaces** (bubblewrap, ``bwrap``): the script runs in new pid, mount, ipc, uts, cgroup and
  (unless ``network=True``) network namespaces. Its file system is a fresh tmpfs holding
  read-only binds of ``/usr`` (and the ``/bin``, ``/lib``… links to it), the interpreter's
  prefixes (the venv alone, never the project around it) and a few harmless files of ``/etc``;
  a ``/proc`` of its own (it sees only its own processes: not the caller, not its environment);
  a minimal ``/dev``; a private ``/tmp``; and its own fresh working directory (also HOME and
  TMPDIR), the only place it can write that outlives a process. Nothing else of the node:
  no home folders, no ``/run`` or ``/var`` (so no path-based unix socket), no project files.
  The environment is built from scratch (``--clearenv``). Privileges are dropped: as root, the
  script runs as ``nobody`` (uid 65534, ``setpriv`` inside the sandbox: no capabilities, an empty
  bounding set, ``no_new_privs``, so ``nsenter``, ``mount`` or a setuid binary give it nothing);
  as another user, in a user namespace mapping that same unprivileged user, all capabilities
  dropped and (bubblewrap >= 0.8) no further user namespaces. When the script's main process
  exits, the sandbox's init exits and the kernel kills everything left in its pid namespace,
  ``setsid`` daemons included; bwrap also dies with the caller (``--die-with-parent``).
- **cgroup**: a cgroup of its own per run (v2, or the v1 ``memory`` and ``pids`` hierarchies),
  created before the script's first instruction (a tiny ``sh`` wrapper joins it, then execs
  bwrap, so every descendant is inside): ``memory_mb`` for all its processes together, swap
  included, and at most ``max_processes`` processes and threads. A run that hit the memory limit
  says so to the model (``[killed: memory limit of N MB for all its processes]``). At the end,
  every process still in the cgroup is killed, then the cgroup is removed.
- Resource limits set by the child itself before the script runs (a bootstrap, not a
  ``preexec_fn``, which is unsafe in a threaded parent): address space per process
  (``memory_mb``: one allocation past it is a ``MemoryError`` the script can catch; the cgroup
  is the limit for the whole tree), CPU seconds (a backstop for the wall limit), file size
  (``max_file_mb``), no core dumps, and in a user namespace ``RLIMIT_NPROC`` (``max_processes``,
  counted per sandbox there).
- A wall-time limit on the whole run; the run also ends as soon as the script's main process
  exits (what it left running is killed, and what is still in the output pipe is read with a
  short deadline, so a descendant holding the pipe cannot stall the call); an output cap (at
  most ``max_output_bytes`` are read; the tree is killed at the first byte past it); stdin is
  the script itself, then EOF; one thread per BLAS library.
- At most ``max_concurrency`` scripts at once per tool instance, so a thousand trajectories
  calling python cannot start a thousand interpreters on one node.
- Cleanup (kill the tree, reap, remove the cgroup and the directory) runs in ``finally`` as a
  shielded task: a call cancelled mid-run still leaves nothing behind.

Why bubblewrap: it is maintained (Flatpak's sandbox), small, packaged everywhere (Debian:
``bubblewrap``), needs no daemon and no setuid bit, and does user/mount/pid/net/ipc/uts
namespaces, the uid and capability drop, environment clearing and die-with-parent in one
audited binary, for ~10 ms per start. nsjail does more (seccomp policies, its own cgroups) but is
not packaged for Debian bookworm; SandboxFusion and similar services are a deployment of their
own (and can sit behind the same ``Tool`` interface later).

What the machine provides is probed once per process (``sandbox_layers()``, ~0.1 s). A
``PythonTool`` with ``isolation="strict"`` (the default) refuses to start without every layer
(``SandboxUnavailable`` says which is missing and how to get it); ``isolation="weaker"`` warns
once and runs with what there is. The fallbacks then: without bubblewrap, the script runs in a
plain child process (under ``unshare --net --pid --fork --kill-child`` when that works, as
before): it shares the node's file system, sees the node's processes and, as root, may do what
root can, so only use it for trusted code. Without a cgroup, memory is limited per process only
(``RLIMIT_AS``: a script that forks can use N times ``memory_mb``), and processes by
``RLIMIT_NPROC`` in a user namespace only (as root the sandbox user ``nobody`` is shared by every
run on the node, and a plain child's count would include the caller's own processes); the pid
namespace and the wall limit still bound a fork bomb's lifetime, not its size.

Not isolated in any mode: CPU time shares (use ``max_concurrency``), disk space in the working
directory beyond ``max_file_mb`` per file, the kernel itself (no seccomp filter: a kernel exploit
escapes every layer; a VM or gVisor-style sandbox is the answer to that), with
``network=True`` the node's network (127.0.0.1 and abstract unix sockets included), and, as
root, what concurrent runs share as the same user ``nobody`` (its kernel keyring).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Mapping
from typing import Any, Literal

import msgspec

from .base import Tool, ToolContext, ToolError, register_tool

logger = logging.getLogger(__name__)


# -- python ----------------------------------------------------------------------------------
# Runs in the child before the script: limits first (they then hold for the script), then the
# script from stdin (no file in its working directory, no argv length limit), tracebacks without
# this bootstrap's frame and with the script's source lines.
_BOOTSTRAP = r"""
import os, resource, sys
def limit(kind, value):
    soft, hard = resource.getrlimit(kind)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(kind, (value, value))
memory, cpu, fsize, nproc = (int(x) for x in sys.argv[1:5])
limit(resource.RLIMIT_AS, memory)
limit(resource.RLIMIT_CPU, cpu)
limit(resource.RLIMIT_FSIZE, fsize)
limit(resource.RLIMIT_CORE, 0)
if nproc:
    limit(resource.RLIMIT_NPROC, nproc)
os.chdir(sys.argv[5])
os.environ.pop("PWD", None)  # bwrap sets it to its own start directory
source = sys.stdin.read()
sys.stdout.reconfigure(line_buffering=True)
import linecache, traceback
linecache.cache["<tool>"] = (len(source), None, source.splitlines(True), "<tool>")
sys.argv = ["<tool>"]
try:
    exec(compile(source, "<tool>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as e:
    traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
    sys.exit(1)
"""

Layer = Literal["namespaces", "cgroup"]
LAYERS: tuple[Layer, ...] = ("namespaces", "cgroup")
Isolation = Literal["strict", "weaker"]

_NOBODY = 65534
_SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
_HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_UNSHARE = (
    (
        "unshare",
        "--pid",
        "--fork",
        "--kill-child",
    ),  # root (CAP_SYS_ADMIN); "--net" is added unless network=True
    ("unshare", "--map-root-user", "--pid", "--fork", "--kill-child"),  # unprivileged user namespaces
)
# Files of /etc that programs need and that hold nothing secret (never shadow, ssh keys, tokens).
_ETC = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "alternatives",
    "nsswitch.conf",
    "passwd",
    "group",
)
_ETC_NETWORK = (
    "resolv.conf",
    "hosts",
    "host.conf",
    "gai.conf",
    "services",
    "protocols",
    "ssl",
    "ca-certificates",
)
# Joins the cgroup(s) named before "--" (its own pid: the exec keeps it), then execs the rest.
_JOIN_CGROUP = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
_CGROUP_PREFIX = "rlasync-python-"
_PROBE_TIMEOUT_S = 10.0
_REAP_TIMEOUT_S = 5.0
_DRAIN_S = 1.0  # after the main process exited and the tree was killed: what is left in the pipe
_OPT_IN = (
    '`agent.tools: {python: {isolation: weaker}}` in a config (`PythonTool(isolation="weaker")` in code)'
)
_cleanups: set[asyncio.Task[None]] = set()  # strong references: the loop only keeps weak ones
_run_ids = itertools.count()


class SandboxUnavailable(RuntimeError):
    """This machine cannot provide every layer of the python sandbox and ``isolation`` is strict."""

    def __init__(self, missing: Mapping[str, str]) -> None:
        super().__init__(
            "python tool: this machine cannot provide the whole sandbox; missing: "
            + "; ".join(f"{layer} ({why})" for layer, why in missing.items())
            + f". To run scripts without it (see rlasync.tools.builtin for what is then not isolated), opt in with {_OPT_IN}."
        )
        self.missing = dict(missing)


# -- what the machine provides (probed once per process) --------------------------------------
@dataclasses.dataclass(frozen=True)
class _Cgroups:
    """Where this process creates one cgroup per run."""

    version: int
    bases: tuple[str, ...]  # v1: (memory hierarchy dir, pids hierarchy dir); v2: (one dir,)

    def create(self, name: str, memory_bytes: int, max_processes: int) -> _RunCgroup:
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
        return _RunCgroup(name, self.version, dirs)

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
class _RunCgroup:
    name: str
    version: int
    dirs: tuple[str, ...]

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(path, "cgroup.procs") for path in self.dirs]

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

    async def kill_all(self, timeout: float = _REAP_TIMEOUT_S) -> bool:
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


@dataclasses.dataclass(frozen=True)
class _Machine:
    """The probe's answer: which layers this machine provides, and how."""

    bwrap: str | None = None
    """bubblewrap, when the namespaces layer works."""
    setpriv: str | None = None
    """As root: drops to ``nobody`` inside the sandbox (bwrap itself runs as root, without a user namespace)."""
    cgroups: _Cgroups | None = None
    unshare: tuple[str, ...] = ()
    """The fallback without bubblewrap (``isolation="weaker"``): () when that does not work either."""
    missing: dict[str, str] = dataclasses.field(default_factory=dict)
    """Layer -> why it is missing and how to get it."""

    @property
    def layers(self) -> frozenset[str]:
        return frozenset(layer for layer in LAYERS if layer not in self.missing)


_MACHINE: _Machine | None = None
_warned_weaker = False


def _machine() -> _Machine:
    global _MACHINE
    if _MACHINE is None:
        _MACHINE = _probe()
    return _MACHINE


def sandbox_layers() -> frozenset[str]:
    """The python sandbox's layers this machine provides (``namespaces``, ``cgroup``): probed once per process."""
    return _machine().layers


def _probe() -> _Machine:
    root = os.geteuid() == 0
    missing: dict[str, str] = {}
    bwrap, setpriv = _which("bwrap"), _which("setpriv")
    if bwrap is None:
        bwrap, missing["namespaces"] = (
            None,
            "bubblewrap is not installed: `apt-get install bubblewrap` (or `make setup` as root)",
        )
    elif root and (setpriv is None or not setpriv.startswith(("/usr/", "/bin/", "/sbin/"))):
        bwrap, missing["namespaces"] = None, "setpriv (util-linux) is not in /usr/bin: install util-linux"
    else:
        why = _probe_bwrap(bwrap, setpriv if root else None)
        if why:
            bwrap, missing["namespaces"] = None, why
    cgroups: _Cgroups | None = None
    try:
        cgroups = _find_cgroups()
        cgroups.remove_stale()
        _probe_cgroup(cgroups)
    except Exception as e:  # noqa: BLE001  (whatever the machine does, the answer is "no cgroup", with why)
        cgroups = None
        missing["cgroup"] = (
            f"no usable cgroup ({e}): run as root with a writable /sys/fs/cgroup, or in a delegated cgroup (systemd Delegate=yes)"
        )
    unshare = () if bwrap else _probe_unshare()
    return _Machine(
        bwrap=bwrap,
        setpriv=setpriv if root and bwrap else None,
        cgroups=cgroups,
        unshare=unshare,
        missing=missing,
    )


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=_HOST_PATH)


def _probe_bwrap(bwrap: str, setpriv: str | None) -> str:
    """Run ``python -I -c pass`` in the sandbox, exactly as a script would run: '' when it works, else why not."""
    workdir = tempfile.mkdtemp(prefix="rlasync-python-probe-")
    try:
        if setpriv:
            os.chown(workdir, _NOBODY, _NOBODY)
        argv = [
            *_bwrap_argv(bwrap, setpriv, workdir, network=False, tmpfs_bytes=64 << 20),
            sys.executable,
            "-I",
            "-c",
            "pass",
        ]
        try:
            done = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=_PROBE_TIMEOUT_S,
                env={"PATH": _HOST_PATH},
                cwd="/",
            )
        except (OSError, subprocess.SubprocessError) as e:
            return f"bubblewrap does not start: {e}"
        if done.returncode != 0:
            said = (done.stdout + done.stderr).decode("utf-8", "replace").strip().splitlines()
            hint = (
                "; as root it needs CAP_SYS_ADMIN (in a container: --cap-add SYS_ADMIN and no seccomp/AppArmor profile that forbids mount namespaces)"
                if setpriv
                else "; as a user other than root it needs unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0)"
            )
            return (
                f"bubblewrap fails here (exit {done.returncode}: {said[-1] if said else 'no output'}){hint}"
            )
        return ""
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _find_cgroups() -> _Cgroups:
    """The cgroup(s) of this process, v1 (memory and pids hierarchies) or v2, and where to create runs'."""
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
        return _Cgroups(1, (v1["memory"], v1["pids"]))
    if v1:
        raise ValueError("the memory and pids controllers are on different cgroup versions")
    if not v2:
        raise ValueError("no cgroup file system is mounted")
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
                return _Cgroups(2, (parent,))  # runs' cgroups are siblings of ours
            raise ValueError(
                f"cannot enable the memory and pids controllers below {v2} (it holds processes)"
            ) from None
    return _Cgroups(2, (v2,))


def _under_mount(mount_point: str, mount_root: str, path: str) -> str:
    if mount_root != "/" and (path == mount_root or path.startswith(mount_root + "/")):
        path = path[len(mount_root) :] or "/"
    elif mount_root != "/":
        raise ValueError(f"this process's cgroup {path} is not under the mount of {mount_root}")
    return os.path.normpath(mount_point + "/" + path)


def _probe_cgroup(cgroups: _Cgroups) -> None:
    """Create a cgroup with limits, put a process in it the way a run does, and remove it."""
    cgroup = cgroups.create(f"{_CGROUP_PREFIX}{os.getpid()}-probe-{next(_run_ids)}", 64 << 20, 8)
    try:
        done = subprocess.run(
            ["/bin/sh", "-c", _JOIN_CGROUP, "sh", *cgroup.procs_files, "--", "cat", "/proc/self/cgroup"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=_PROBE_TIMEOUT_S,
            env={"PATH": _HOST_PATH},
            cwd="/",
        )
        if done.returncode != 0 or done.stdout.count(cgroup.name.encode()) < len(cgroup.dirs):
            raise ValueError(
                f"cannot move a process into {cgroup.dirs[0]}: {done.stderr.decode(errors='replace').strip()}"
            )
    finally:
        cgroup.remove()


def _probe_unshare() -> tuple[str, ...]:
    if _which("unshare") is None:
        return ()
    for prefix in _UNSHARE:
        prefix = (_which("unshare") or "unshare", *prefix[1:])
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            argv = [*prefix[:-3], "--net", *prefix[-3:], sys.executable, "-I", "-c", "pass"]
            if (
                subprocess.run(
                    argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=_PROBE_TIMEOUT_S
                ).returncode
                == 0
            ):
                return prefix
    return ()


def _bwrap_argv(
    bwrap: str, setpriv: str | None, workdir: str, *, network: bool, tmpfs_bytes: int
) -> list[str]:
    """bubblewrap and its options, up to the command: see the module docstring."""
    options = _bwrap_options(bwrap)
    argv = [bwrap, "--die-with-parent", "--new-session", "--hostname", "sandbox"]
    if (
        setpriv
    ):  # root: no user namespace (bwrap has root's powers to build the sandbox), then setpriv to nobody
        argv += ["--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]
        argv += [] if network else ["--unshare-net"]
        argv += [
            "--cap-drop",
            "ALL",
            "--cap-add",
            "CAP_SETUID",
            "--cap-add",
            "CAP_SETGID",
            "--cap-add",
            "CAP_SETPCAP",
        ]
    else:  # another user: a user namespace mapping that user, nothing more
        argv += ["--unshare-all", "--unshare-user", "--cap-drop", "ALL"]
        argv += ["--disable-userns"] if "--disable-userns" in options else []  # bubblewrap >= 0.8
        argv += ["--share-net"] if network else []
    size = ["--size", str(tmpfs_bytes)] if "--size" in options else []
    visible = {"/usr"}  # bound with their content: what lies below exists
    dirs = {"/"}  # empty directories and mount points made here
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
            visible.add(top)
    argv += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", *size, "--tmpfs", "/dev/shm"]
    argv += ["--perms", "1777", *size, "--tmpfs", "/tmp", "--perms", "0755", "--dir", "/etc"]
    dirs |= {"/proc", "/dev", "/tmp", "/etc"}
    for name in _ETC + (_ETC_NETWORK if network else ()):
        argv += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    prefixes = (sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix)
    for prefix in dict.fromkeys(os.path.realpath(p) for p in prefixes):
        if prefix != "/" and not _inside(prefix, visible):  # a venv: itself only, never the project around it
            argv += [*_parents(prefix, visible, dirs), "--ro-bind", prefix, prefix]
            visible.add(prefix)
    argv += [*_parents(workdir, visible, dirs), "--bind", workdir, workdir, "--clearenv"]
    for key, value in _env(workdir).items():
        argv += ["--setenv", key, value]
    argv += ["--"]
    if setpriv:
        argv += [
            setpriv,
            f"--reuid={_NOBODY}",
            f"--regid={_NOBODY}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
            "--",
        ]
    return argv


@functools.cache
def _bwrap_options(bwrap: str) -> frozenset[str]:
    """The options this bubblewrap knows (from its --help): some came late (--disable-userns: 0.8)."""
    try:
        done = subprocess.run(
            [bwrap, "--help"], capture_output=True, timeout=_PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    return frozenset(
        word for word in (done.stdout + done.stderr).decode(errors="replace").split() if word.startswith("--")
    )


def _inside(path: str, roots: set[str]) -> bool:
    return any(path == root or path.startswith(root + "/") for root in roots)


def _parents(path: str, visible: set[str], dirs: set[str]) -> list[str]:
    """``--dir`` for each missing ancestor of ``path``, world-readable (bwrap makes its own 0700)."""
    argv: list[str] = []
    parts = path.strip("/").split("/")[:-1]
    for i in range(1, len(parts) + 1):
        parent = "/" + "/".join(parts[:i])
        if parent not in dirs and not _inside(parent, visible):
            argv += ["--perms", "0755", "--dir", parent]
            dirs.add(parent)
    return argv


def _env(workdir: str) -> dict[str, str]:
    # Built from scratch: nothing of the node's environment (proxies, tokens, CUDA devices) leaks.
    return {
        "PATH": _SANDBOX_PATH,
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


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


# -- one run ------------------------------------------------------------------------------------
class PythonRun(msgspec.Struct, kw_only=True):
    """What one sandboxed run did."""

    output: str
    """stdout and stderr interleaved, decoded as UTF-8 (invalid bytes replaced), at most the cap."""
    exit_code: int | None
    """The script's exit status (negative: killed by that signal; in a sandbox an exit status of
    128+N is read as signal N, as a shell does); None when it was killed by us."""
    timed_out: bool = False
    output_truncated: bool = False
    memory_limit: bool = False
    """The kernel killed a process of the run at the memory limit of the whole tree (cgroup)."""
    process_limit: bool = False
    """A fork or thread start failed at ``max_processes`` (cgroup)."""
    elapsed_s: float = 0.0


async def run_python(
    code: str,
    *,
    wall_time_s: float,
    memory_bytes: int,
    max_output_bytes: int,
    max_file_bytes: int,
    max_processes: int = 64,
    network: bool = False,
    layers: Collection[str] | None = None,
) -> PythonRun:
    """Run ``code`` in a fresh sandbox under the limits (see the module docstring); never hangs.

    ``layers``: which of this machine's layers to use (default: every one it has).
    """
    start = time.perf_counter()
    machine = _machine()
    use = machine.layers if layers is None else machine.layers & set(layers)
    bwrap = machine.bwrap if "namespaces" in use else None
    cgroups = machine.cgroups if "cgroup" in use else None
    loop = asyncio.get_running_loop()
    workdir = tempfile.mkdtemp(prefix="rlasync-python-")  # one mkdir: cheap enough for the event loop
    proc: asyncio.subprocess.Process | None = None
    cgroup: _RunCgroup | None = None
    transport: asyncio.ReadTransport | None = None
    try:
        if bwrap and machine.setpriv:
            os.chown(workdir, _NOBODY, _NOBODY)
        # RLIMIT_NPROC counts a user's processes: per sandbox in a user namespace, else it would
        # count the caller's own processes (a plain child) or every run's (root's "nobody").
        nproc = max_processes if bwrap and not machine.setpriv else 0
        python = [
            sys.executable,
            "-I",
            "-X",
            "utf8",
            "-c",
            _BOOTSTRAP,
            str(memory_bytes),
            str(math.ceil(wall_time_s) + 1),
            str(max_file_bytes),
            str(nproc),
            workdir,
        ]
        if bwrap:
            argv = (
                _bwrap_argv(bwrap, machine.setpriv, workdir, network=network, tmpfs_bytes=memory_bytes)
                + python
            )
        elif machine.unshare:
            argv = [*machine.unshare[:-3], *([] if network else ["--net"]), *machine.unshare[-3:], *python]
        else:
            argv = python
        if cgroups:
            cgroup = cgroups.create(
                f"{_CGROUP_PREFIX}{os.getpid()}-{next(_run_ids)}", memory_bytes, max_processes
            )
            argv = ["/bin/sh", "-c", _JOIN_CGROUP, "sh", *cgroup.procs_files, "--", *argv]
        # The script is stdin (a memfd: no pipe to feed); the output is a pipe of ours, so that
        # waiting for the process never waits for a descendant that holds the pipe.
        script = read_fd = write_fd = -1
        try:
            script = os.memfd_create("rlasync-python-script", os.MFD_CLOEXEC)
            read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
            os.write(script, code.encode("utf-8", "replace"))  # a memfd write: memory only
            os.lseek(script, 0, os.SEEK_SET)
            reader = asyncio.StreamReader()
            pipe, read_fd = os.fdopen(read_fd, "rb", buffering=0), -1
            try:
                transport, _ = await loop.connect_read_pipe(
                    lambda: asyncio.StreamReaderProtocol(reader), pipe
                )
            except BaseException:
                pipe.close()
                raise
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=script,
                stdout=write_fd,
                stderr=asyncio.subprocess.STDOUT,
                cwd=workdir if not bwrap else "/",
                env=_env(workdir) if not bwrap else {"PATH": _HOST_PATH},
                start_new_session=True,
            )
        finally:
            for fd in (script, write_fd, read_fd):
                if fd >= 0:
                    os.close(fd)
        output, timed_out, truncated = bytearray(), False, False
        reading = asyncio.ensure_future(_read_capped(reader, output, max_output_bytes))
        exiting = asyncio.ensure_future(proc.wait())
        try:
            async with asyncio.timeout(wall_time_s):
                await asyncio.wait((reading, exiting), return_when=asyncio.FIRST_COMPLETED)
                truncated = reading.done() and reading.result()
                if not truncated:
                    await exiting  # EOF may come first: a script that closed its output still runs
                    await _kill_tree(proc, cgroup)  # the run ends with its main process
                    try:
                        async with asyncio.timeout(_DRAIN_S):
                            truncated = await reading
                    except TimeoutError:  # something out of our reach holds the pipe: stop reading
                        pass
        except TimeoutError:
            timed_out = True
        finally:
            reading.cancel()
            exiting.cancel()
        exit_code = None if timed_out or truncated else proc.returncode
        if exit_code is not None and (bwrap or machine.unshare) and 128 < exit_code < 128 + signal.NSIG:
            exit_code = 128 - exit_code  # the wrapper reports a signal as 128+N, like a shell
        return PythonRun(
            output=output.decode("utf-8", "replace"),
            exit_code=exit_code,
            timed_out=timed_out,
            output_truncated=truncated,
            memory_limit=cgroup is not None and cgroup.oom_killed(),
            process_limit=cgroup is not None and cgroup.forks_refused(),
            elapsed_s=time.perf_counter() - start,
        )
    finally:
        # A second cancellation must not skip the cleanup: it runs as its own task.
        cleanup = asyncio.ensure_future(_cleanup(proc, cgroup, transport, workdir))
        _cleanups.add(cleanup)
        cleanup.add_done_callback(_cleanups.discard)
        await asyncio.shield(cleanup)


async def _read_capped(stream: asyncio.StreamReader, out: bytearray, cap: int) -> bool:
    """Read to EOF into ``out``; stop with True as soon as more than ``cap`` bytes came."""
    while chunk := await stream.read(65536):
        out += chunk
        if len(out) > cap:
            del out[cap:]
            return True
    return False


async def _kill_tree(proc: asyncio.subprocess.Process | None, cgroup: _RunCgroup | None) -> None:
    """SIGKILL the run's every process: its cgroup, its process group, and bwrap (whose death
    takes the sandbox's pid namespace with it)."""
    if proc is not None:
        if proc.returncode is None:  # not reaped yet: the pid is still ours
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # gone, or the pid reused by someone else's group
            pass
    if cgroup is not None:
        await cgroup.kill_all()


async def _cleanup(
    proc: asyncio.subprocess.Process | None,
    cgroup: _RunCgroup | None,
    transport: asyncio.ReadTransport | None,
    workdir: str,
) -> None:
    try:
        await _kill_tree(proc, cgroup)
        if proc is not None:
            try:
                async with asyncio.timeout(_REAP_TIMEOUT_S):
                    await proc.wait()
            except TimeoutError:
                logger.warning(
                    "python tool: child %d did not exit %.0fs after SIGKILL", proc.pid, _REAP_TIMEOUT_S
                )
    finally:
        if transport is not None:
            transport.close()
        if cgroup is not None:
            cgroup.remove()
        # rmtree may take long on a script's many files: in a thread, never on the loop.
        await asyncio.to_thread(shutil.rmtree, workdir, ignore_errors=True)


@register_tool
class PythonTool(Tool):
    """Runs a Python script in a sandbox and returns what it printed.

    A limit hit is an error result (``timeout``, ``output_limit``) showing the output so far; a
    script that fails (an exception, ``MemoryError`` at the memory limit, a non-zero exit) is a
    normal result: its traceback and ``[exit code N]`` are what the model learns from, and a
    process killed at the memory limit of the whole tree, or a fork refused at the process limit,
    is said in a last line. An instance belongs to one event loop (its concurrency semaphore):
    build one per worker.
    """

    name = "python"
    description = (
        "Run a Python 3 script and return what it prints (stdout and stderr). Every call starts fresh: "
        "no variables, files or network carry over; print the results you need."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The Python source to run."}},
        "required": ["code"],
    }
    timeout_s = None  # the run has its own wall limit; time spent waiting for a free slot must not count

    def __init__(
        self,
        *,
        wall_time_s: float = 10.0,
        memory_mb: int = 1024,
        max_output_bytes: int = 65536,
        max_file_mb: int = 64,
        max_concurrency: int | None = None,
        max_processes: int = 64,
        network: bool = False,
        isolation: Isolation = "strict",
    ) -> None:
        """
        Args:
            wall_time_s: Kill the script after this long (interpreter start included).
            memory_mb: Memory of all the script's processes together (a cgroup), and the
                address-space limit of each; importing numpy needs about 200.
            max_output_bytes: Read at most this much output; one byte more kills the script.
            max_file_mb: Largest file the script may write.
            max_concurrency: Scripts running at once per instance (default: the CPU count).
            max_processes: Processes and threads of one run together (the sandbox's own two included).
            network: Share the node's network (127.0.0.1 included); every other layer stays.
            isolation: ``strict`` raises ``SandboxUnavailable`` here when the machine lacks a
                layer of the sandbox (``sandbox_layers()``); ``weaker`` warns once and runs with
                the layers there are (see the module docstring for what is then not isolated).

        Raises:
            SandboxUnavailable: ``isolation="strict"`` and a layer is missing.
        """
        checks = {
            "wall_time_s": wall_time_s > 0,
            "memory_mb": memory_mb >= 32,
            "max_output_bytes": max_output_bytes > 0,
            "max_file_mb": max_file_mb >= 0,
            "max_concurrency": max_concurrency is None or max_concurrency >= 1,
            "max_processes": max_processes >= 4,
            "network": isinstance(network, bool),
            "isolation": isolation in ("strict", "weaker"),
        }
        bad = [key for key, ok in checks.items() if not ok]
        if bad:
            raise ValueError(
                f"PythonTool: invalid {', '.join(bad)} (see the PythonTool docstring for valid values)"
            )
        self.wall_time_s, self.memory_mb, self.max_output_bytes = wall_time_s, memory_mb, max_output_bytes
        self.max_file_mb, self.max_processes, self.network, self.isolation = (
            max_file_mb,
            max_processes,
            network,
            isolation,
        )
        self._slots = asyncio.Semaphore(max_concurrency or os.cpu_count() or 1)
        missing = _machine().missing
        if missing and isolation == "strict":
            raise SandboxUnavailable(missing)
        if missing:
            _warn_weaker(missing)

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> str:
        async with self._slots:
            run = await run_python(
                arguments["code"],
                wall_time_s=self.wall_time_s,
                memory_bytes=self.memory_mb << 20,
                max_output_bytes=self.max_output_bytes,
                max_file_bytes=self.max_file_mb << 20,
                max_processes=self.max_processes,
                network=self.network,
            )
        return self.format(run)

    def format(self, run: PythonRun) -> str:
        """The text the model sees; a hit limit raises ``ToolError`` (with the output before it)."""
        if run.timed_out:
            tail = f" Output before the kill:\n{run.output}" if run.output else ""
            raise ToolError(
                f"timed out after {self.wall_time_s:g}s (wall-time limit); the script was killed.{tail}",
                kind="timeout",
            )
        if run.output_truncated:
            raise ToolError(
                f"output exceeded {self.max_output_bytes} bytes; the script was killed. "
                f"The first {self.max_output_bytes} bytes:\n{run.output}",
                kind="output_limit",
            )
        lines = [run.output.rstrip("\n")] if run.output.rstrip("\n") else []
        if run.exit_code is not None and run.exit_code != 0:
            lines.append(
                f"[exit code {run.exit_code}]"
                if run.exit_code > 0
                else f"[killed by signal {-run.exit_code}]"
            )
        if run.memory_limit:
            lines.append(f"[killed: memory limit of {self.memory_mb} MB for all its processes]")
        if run.process_limit:
            lines.append(f"[process limit of {self.max_processes} reached: a fork or thread start failed]")
        return "\n".join(lines) or "(no output)"


def _warn_weaker(missing: Mapping[str, str]) -> None:
    global _warned_weaker
    if _warned_weaker:
        return
    _warned_weaker = True
    lost = []
    if "namespaces" in missing:
        who = "root (everything on the node)" if os.geteuid() == 0 else "the node's user"
        kept = (
            "only the network and pid namespaces of `unshare`"
            if _machine().unshare
            else "no namespace at all"
        )
        lost.append(f"scripts run as {who}, see the node's files and processes, and have {kept}")
    if "cgroup" in missing:
        lost.append(
            "memory is limited per process only (a script that forks can use more), and processes only in a user namespace"
        )
    logger.warning(
        "python tool: running with a weaker sandbox (isolation=weaker): %s. Missing: %s",
        "; ".join(lost),
        "; ".join(f"{layer} ({why})" for layer, why in missing.items()),
    )
