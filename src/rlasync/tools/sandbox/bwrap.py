"""The sandbox's namespace layer: bubblewrap's command line, what the script sees, its environment.

``bwrap_argv`` builds bubblewrap and its options up to the command: new pid, mount, ipc, uts,
cgroup and (unless ``network=True``) network namespaces; a file system that is a fresh tmpfs
holding read-only binds of ``/usr`` (and the ``/bin``, ``/lib``… links to it), the interpreter's
prefixes (the venv alone, never the project around it) and a few harmless files of ``/etc``; a
``/proc`` of its own; a minimal ``/dev``; a private ``/tmp``; the run's working directory, bound
writable; the environment from scratch (``sandbox_env``). As root, no user namespace (bwrap
builds the sandbox with root's powers) and ``setpriv`` then drops to ``nobody`` with no
capabilities, an empty bounding set and ``no_new_privs``; as another user, a user namespace
mapping that user, all capabilities dropped and (bubblewrap >= 0.8) no further user namespaces.

Why bubblewrap: it is maintained (Flatpak's sandbox), small, packaged everywhere (Debian:
``bubblewrap``), needs no daemon and no setuid bit, and does user/mount/pid/net/ipc/uts
namespaces, the uid and capability drop, environment clearing and die-with-parent in one
audited binary, for ~10 ms per start. nsjail does more (seccomp policies, its own cgroups) but is
not packaged for Debian bookworm; SandboxFusion and similar services are a deployment of their
own (and can sit behind the same ``Tool`` interface later).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

NOBODY = 65534
"""The uid and gid a script runs as when rlasync runs as root."""
HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""The PATH of the node's own tools (bwrap, setpriv, unshare), whatever the caller's PATH."""
_SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
_HELP_TIMEOUT_S = 10.0
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


def bwrap_argv(
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
    argv += _file_system(
        workdir, network=network, size=["--size", str(tmpfs_bytes)] if "--size" in options else []
    )
    argv += ["--clearenv"]
    for key, value in sandbox_env(workdir).items():
        argv += ["--setenv", key, value]
    argv += ["--"]
    if setpriv:
        argv += [
            setpriv,
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
            "--",
        ]
    return argv


def _file_system(workdir: str, *, network: bool, size: list[str]) -> list[str]:
    """The options that build what the script sees of the file system (``size``: of each tmpfs)."""
    visible = {"/usr"}  # bound with their content: what lies below exists
    dirs = {"/"}  # empty directories and mount points made here
    argv = ["--ro-bind", "/usr", "/usr"]
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
    return argv + [*_parents(workdir, visible, dirs), "--bind", workdir, workdir]


@functools.cache
def _bwrap_options(bwrap: str) -> frozenset[str]:
    """The options this bubblewrap knows (from its --help): some came late (--disable-userns: 0.8)."""
    try:
        done = subprocess.run(
            [bwrap, "--help"], capture_output=True, timeout=_HELP_TIMEOUT_S, stdin=subprocess.DEVNULL
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


def sandbox_env(workdir: str) -> dict[str, str]:
    """A script's whole environment (in the sandbox, or in a plain child without one)."""
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
