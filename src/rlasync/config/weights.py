"""Settings of the weight sync from the trainer to the engines (``weights.*``)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec


class WeightsConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """How new parameters reach the engines after each step (``weights.*``)."""

    bucket_mb: Annotated[float, msgspec.Meta(gt=0)] = 64.0
    """Small tensors are packed into buckets of this size; one collective moves each bucket."""
    alone_mb: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Tensors at least this big travel alone, straight from their memory (no packing copy);
    0: those of a whole bucket or more. Fewer, bigger collectives won on CPU/gloo (measured);
    with NCCL, where a collective costs little, 1-4 MB may be faster."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """The weight group's backend: ``auto`` is NCCL when trainer and engines are on GPUs, else gloo."""
    host: str = ""
    """Where the weight group meets: the trainer's rank 0 hosts its rendezvous store, and the
    engines that take the broadcast connect there. Empty: the address of rank 0's node, as the
    other nodes reach it (``127.0.0.1`` on a local cluster); set it when that is not the address
    other machines should use (several network interfaces)."""
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 120.0
    """Deadline of every collective of a sync: a peer that died fails it at once, one that
    stalls fails it when this passes. Raise it if a sync of your model is just slow."""
    retries: Annotated[int, msgspec.Meta(ge=0)] = 1
    """After a failed sync, make a new group (a new generation) and sync again; an engine that
    still answers but fails more than this many times in one sync is handled as
    ``on_engine_failure`` says. Engines keep serving their last complete version meanwhile."""
    on_engine_failure: Literal["remove", "stop"] = "remove"
    """An engine that died, stalls, or keeps failing a sync: ``remove`` takes it out of rotation
    (the router sends it nothing more; the run goes on with the others, and stops only when no
    engine is left), ``stop`` ends the run with ``SyncError``."""
    transport: Literal["auto", "broadcast", "shm"] = "auto"
    """``auto``: engines that share the trainer's machine copy each version from its shared
    memory (no socket), the others take the broadcast; ``broadcast``: all take the broadcast;
    ``shm``: all must share the machine (an error at start-up otherwise). With ``auto``, shared
    memory is used for CPU parameters and NCCL for GPU ones; with ``shm`` a GPU trainer copies
    each version into host shared memory too, and the engines copy it onto their GPU: the
    same-device path of ``cluster.colocate`` (NCCL refuses two ranks on one GPU)."""
    shm_dir: str = "/dev/shm"
    """Where the trainer's shared-memory file lives (a tmpfs, so it is memory, not disk). It
    holds a copy of the parameters' size; the trainer's rank 0 keeps its parameters there."""
    max_live_versions: Annotated[int, msgspec.Meta(ge=1)] = 2
    """Versions the trainer's relay holds (a shared-memory file on its machine, on CPU): each
    version is copied into a slot after its step (one ``memcpy``); the engines on the machine
    copy it from there and the pair groups to other machines send from there, so no transfer
    reads parameters a step is changing. With two or more, the fully asynchronous schedule
    (``async_training.commit=each``) trains on as soon as the relay holds a version, and each
    engine pulls the newest one at its own pace (serving and staging: two). A slot a send still
    reads is never overwritten: an engine more than this many minus one versions behind and
    still receiving holds the trainer's next publish until its send ends (raise it to let slow
    engines lag further; each slot is a copy of the parameters). 1: no relay; the trainer's
    parameters live in the file itself and every step waits for every engine. On GPUs the NCCL
    broadcast sends from the parameters and every step waits (a pinned-memory relay is not
    written)."""
    node_relay: bool = True
    """Engines on one node (one process) that take the broadcast share it: the first of them
    receives each version over its pair group and keeps it in the node's relay
    (``max_live_versions`` slots; pinned memory on GPUs), and the others copy it from there,
    so the trainer sends each version once per node. False: a pair group per engine."""
    double_buffer: bool = True
    """Engines that can swap a version in by reference (the torch engine) keep two staging
    copies, so the pause is pointer swaps; false: one copy, and the engine copies each version
    into its weights (less memory, a longer pause). Others (vLLM, SGLang) copy with one."""
