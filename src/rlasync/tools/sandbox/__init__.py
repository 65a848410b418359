"""The python tool's sandbox: one script per run, isolated from the node and from other runs.

    from rlasync.tools.sandbox import run_python, sandbox_layers

    sandbox_layers()                      # {"namespaces", "cgroup"} where the machine has both
    run = await run_python("print(6 * 7)", wall_time_s=5, memory_bytes=256 << 20,
                           max_output_bytes=65536, max_file_bytes=64 << 20)
    run.output, run.exit_code             # "42\\n", 0

It has to hold against the code it runs, also when rlasync itself runs as root (CI, most
containers). Its layers, probed once per process (``probe.py``):

- **namespaces** (bubblewrap, ``bwrap.py``): new pid, mount, ipc, uts, cgroup and (unless
  ``network=True``) network namespaces; a file system of read-only system files, the
  interpreter's prefixes and a fresh working directory (also HOME and TMPDIR), the only place it
  can write that outlives a process: no home folders, no ``/run`` or ``/var`` (so no path-based
  unix socket), no project files; a ``/proc`` of its own (only its own processes); an environment
  built from scratch. As root, the script runs as ``nobody`` (``setpriv``: no capabilities, an
  empty bounding set, ``no_new_privs``, so ``nsenter``, ``mount`` or a setuid binary give it
  nothing); as another user, in a user namespace mapping that user, all capabilities dropped.
  When the script's main process exits, the kernel kills everything left in its pid namespace,
  ``setsid`` daemons included; bwrap also dies with the caller.
- **cgroup** (``cgroups.py``): a cgroup of its own per run, joined before the script's first
  instruction: memory for all its processes together (swap included), and at most
  ``max_processes`` processes and threads. At the end, every process in it is killed.
- Per run (``run.py``): resource limits per process, a wall-time limit, an output cap, stdin
  the script itself; cleanup that a cancelled call does not skip.

``SandboxUnavailable`` says which layer is missing and how to get it; the python tool refuses to
start without every layer unless given ``isolation="weaker"``. The fallbacks then: without
bubblewrap (or, as root, without ``setpriv``), the script runs in a plain child process (under
``unshare --net --pid --fork --kill-child`` when that works): it shares the node's file system,
sees the node's processes and, as root, may do what root can, so only use it for trusted code.
Without a cgroup, memory is limited per process only (``RLIMIT_AS``: a script that forks can use
N times ``memory_bytes``), and processes by ``RLIMIT_NPROC`` in a user namespace only (as root
the sandbox user ``nobody`` is shared by every run on the node, and a plain child's count would
include the caller's own processes); the pid namespace and the wall limit still bound a fork
bomb's lifetime, not its size.

Not isolated in any mode: CPU time shares (the tool's ``max_concurrency``), disk space in the
working directory beyond ``max_file_bytes`` per file, the kernel itself (no seccomp filter: a
kernel exploit escapes every layer; a VM or gVisor-style sandbox is the answer to that), with
``network=True`` the node's network (127.0.0.1 and abstract unix sockets included), and, as
root, what concurrent runs share as the same user ``nobody`` (its kernel keyring).
"""

from __future__ import annotations

from .probe import LAYERS, Layer, SandboxUnavailable, sandbox_layers
from .run import PythonRun, run_python

__all__ = ["LAYERS", "Layer", "PythonRun", "SandboxUnavailable", "run_python", "sandbox_layers"]
