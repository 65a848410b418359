"""What this machine offers the sandbox: bubblewrap (and ``setpriv`` as root), cgroups, ``unshare``.

Probed once per process (``machine()``, ~0.1 s) by doing what a run does: a script started in
bubblewrap exactly as a run starts one, a cgroup created with limits and a process moved into it.
A layer that fails is missing, with why and how to get it (``Machine.missing``); without
bubblewrap, ``unshare`` is probed as the fallback of ``isolation="weaker"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from typing import Literal

from .bwrap import HOST_PATH, NOBODY, bwrap_argv
from .cgroups import Cgroups, find_cgroups

Layer = Literal["namespaces", "cgroup"]
LAYERS: tuple[Layer, ...] = ("namespaces", "cgroup")

_PROBE_TIMEOUT_S = 10.0
_UNSHARE = (
    (
        "unshare",
        "--pid",
        "--fork",
        "--kill-child",
    ),  # root (CAP_SYS_ADMIN); "--net" is added unless network=True
    ("unshare", "--map-root-user", "--pid", "--fork", "--kill-child"),  # unprivileged user namespaces
)
_OPT_IN = (
    '`agent.tools: {python: {isolation: weaker}}` in a config (`PythonTool(isolation="weaker")` in code)'
)


class SandboxUnavailable(RuntimeError):
    """This machine cannot provide every layer of the python sandbox and ``isolation`` is strict."""

    def __init__(self, missing: Mapping[str, str]) -> None:
        super().__init__(
            "python tool: this machine cannot provide the whole sandbox; missing: "
            + "; ".join(f"{layer} ({why})" for layer, why in missing.items())
            + f". To run scripts without it (see rlasync.tools.sandbox for what is then not isolated), opt in with {_OPT_IN}."
        )
        self.missing = dict(missing)


@dataclasses.dataclass(frozen=True)
class Machine:
    """The probe's answer: which layers this machine provides, and how."""

    bwrap: str | None = None
    """bubblewrap, when the namespaces layer works."""
    setpriv: str | None = None
    """As root: drops to ``nobody`` inside the sandbox (bwrap itself runs as root, without a user namespace)."""
    cgroups: Cgroups | None = None
    unshare: tuple[str, ...] = ()
    """The fallback without bubblewrap (``isolation="weaker"``): () when that does not work either."""
    missing: dict[str, str] = dataclasses.field(default_factory=dict)
    """Layer -> why it is missing and how to get it."""

    @property
    def layers(self) -> frozenset[str]:
        return frozenset(layer for layer in LAYERS if layer not in self.missing)


_MACHINE: Machine | None = None


def machine() -> Machine:
    """This machine's answer, probed on the first call."""
    global _MACHINE
    if _MACHINE is None:
        _MACHINE = _probe()
    return _MACHINE


def sandbox_layers() -> frozenset[str]:
    """The python sandbox's layers this machine provides (``namespaces``, ``cgroup``): probed once per process."""
    return machine().layers


def _probe() -> Machine:
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
    cgroups: Cgroups | None = None
    try:
        cgroups = find_cgroups()
        cgroups.remove_stale()
        _probe_cgroup(cgroups)
    except Exception as e:  # noqa: BLE001  (whatever the machine does, the answer is "no cgroup", with why)
        cgroups = None
        missing["cgroup"] = (
            f"no usable cgroup ({e}): run as root with a writable /sys/fs/cgroup, or in a delegated cgroup (systemd Delegate=yes)"
        )
    unshare = () if bwrap else _probe_unshare()
    return Machine(
        bwrap=bwrap,
        setpriv=setpriv if root and bwrap else None,
        cgroups=cgroups,
        unshare=unshare,
        missing=missing,
    )


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=HOST_PATH)


def _probe_bwrap(bwrap: str, setpriv: str | None) -> str:
    """Run ``python -I -c pass`` in the sandbox, exactly as a script would run: '' when it works, else why not."""
    workdir = tempfile.mkdtemp(prefix="rlasync-python-probe-")
    try:
        if setpriv:
            os.chown(workdir, NOBODY, NOBODY)
        argv = [
            *bwrap_argv(bwrap, setpriv, workdir, network=False, tmpfs_bytes=64 << 20),
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
                env={"PATH": HOST_PATH},
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


def _probe_cgroup(cgroups: Cgroups) -> None:
    """Create a cgroup with limits, put a process in it the way a run does, and remove it."""
    cgroup = cgroups.create(64 << 20, 8, tag="probe-")
    try:
        done = subprocess.run(
            cgroup.join_argv(["cat", "/proc/self/cgroup"]),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=_PROBE_TIMEOUT_S,
            env={"PATH": HOST_PATH},
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
