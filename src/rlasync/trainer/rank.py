"""``TrainerRank``: one data-parallel rank of the trainer, an actor of the runtime.

    child = await node.start_child(preload=("rlasync.trainer.rank",))   # a process node-1 supervises
    rank = await node.spawn(TrainerRank, RankSpec(rank=1, world_size=2, ...), node=child.node_id)
    await rank.join(); await rank.load(model_dir, 100); metrics = await rank.step(...)

A rank lives in a node process of its own, started and supervised by the node it is placed on
(``cluster.trainer``), because torch.distributed's group and a device belong to a process. Its
calls run one at a time, in order, on one thread of that process: they are collective (every
rank runs the same call in the same order), and the process's event loop stays free to answer
heartbeats and cancellations while the thread computes. ``TrainerActor`` drives the ranks.

The ranks meet at a TCP store the driver names (the head's, or ``MASTER_ADDR:MASTER_PORT``):
``join`` is ``init_process_group`` under ``trainer.start_timeout_s``, and every collective has
``trainer.operation_timeout_s``. A collective that fails (a peer rank died, or stalled past the
deadline) leaves the group unusable: the rank answers every later call with ``GroupBroken``.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import datetime
import gc
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from ..config.train import TrainerConfig
from ..runtime import Actor, endpoint
from ..runtime.address import host_of, interface_of
from ..runtime.errors import first_line
from ..weights.protocol import GroupAddress  # at import: join_weights's hint must resolve
from .background import in_background
from .device import pick_device
from .policy import PolicyTrainer
from .state import rng_state, set_rng_state
from .thread import WorkThread
from .types import TrainBatch

log = logging.getLogger(__name__)


class GroupBroken(RuntimeError):
    """A collective of the trainer's group failed (a peer rank died, or stalled past
    ``trainer.operation_timeout_s``): the group cannot be used again; restart from a
    checkpoint."""


class RankSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What one rank is built from (it travels to the rank's process)."""

    rank: int
    world_size: int
    store_host: str
    """The TCP store all ranks meet at: the head's, or ``MASTER_ADDR`` under torchrun."""
    store_port: int
    group: str
    """The key prefix of this trainer's group in the store (one trainer, one prefix)."""
    device_index: int = 0
    """This rank's GPU among its machine's (the placement counts the machine's engines first)."""
    devices_needed: int = 0
    """GPUs a machine must have for ``trainer.device=auto`` to train on them: the highest
    ``device_index`` of any rank, plus one. Every rank decides from the same number, so all train
    on GPUs or all on the CPU (a group with both could not agree on NCCL or gloo)."""
    config: TrainerConfig = TrainerConfig()


class TrainerRank(Actor):
    """The endpoints of one rank; each runs on the rank's thread and returns plain data or tensors."""

    def __init__(self, spec: RankSpec | dict[str, Any]) -> None:
        self.spec = spec if isinstance(spec, RankSpec) else msgspec.convert(spec, RankSpec)
        self.rank, self.world_size, self.config = self.spec.rank, self.spec.world_size, self.spec.config
        self.device = torch.device("cpu")
        self.trainer: PolicyTrainer | None = None
        self.senders: Any = None  # the PeerSenders (weights.fanout), on rank 0 once joined
        self.weight_group_store: Any = None  # rank 0: the weight group's TCP store, hosted here
        self.flat: Any = None  # the buffer rank 0's parameters live in once laid out as buckets
        self.shared: Any = None  # SharedWeights: the same-host fast path, when offered
        self.broken = ""
        self._closed = False
        self._writing: asyncio.Future[None] | None = (
            None  # a checkpoint being written (``save(background=True)``)
        )

    async def on_start(self) -> None:
        self._thread = WorkThread(f"trainer-rank{self.rank}")

    async def on_stop(self) -> None:
        await self.shutdown()

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.broken:
            raise GroupBroken(f"trainer rank {self.rank}: {self.broken}")
        if self._closed:
            raise RuntimeError(f"trainer rank {self.rank} is shut down")
        try:
            return await self._thread.submit(fn, *args)
        except (dist.DistBackendError, dist.DistNetworkError) as exc:
            self.broken = f"its group broke during {fn.__name__} (a peer rank died, or stalled past trainer.operation_timeout_s): {first_line(exc)}"
            log.error("trainer rank %d: %s", self.rank, self.broken)
            raise GroupBroken(f"trainer rank {self.rank}: {self.broken}") from None

    def _trainer(self) -> PolicyTrainer:
        if self.trainer is None:
            raise RuntimeError("the trainer has no model yet: call load first")
        return self.trainer

    # -- lifecycle ----------------------------------------------------------------------------
    @endpoint
    async def join(self) -> dict[str, Any]:
        """Join the trainer's torch.distributed group (blocks until every rank has)."""
        return dict(await self._run(self._join))

    def _join(self) -> dict[str, Any]:
        cfg = self.config
        if cfg.cpu_affinity:
            wanted = set(cfg.cpu_affinity)
            usable = wanted & set(range(os.cpu_count() or 1))  # the machine's cores, not the ones inherited
            if usable:
                os.sched_setaffinity(
                    0, usable
                )  # this thread (Linux): the rank's compute, and threads it starts
            else:
                log.warning(
                    "trainer.cpu_affinity=%s: none of these cores is available here; running on any",
                    sorted(wanted),
                )
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = pick_device(cfg.device, self.spec.device_index, self.spec.devices_needed)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if dist.is_initialized():
            raise RuntimeError(
                "this process already has a torch.distributed group: a trainer rank needs a process of its own"
            )
        if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
            # Gloo listens where the hostname resolves unless told: pin it to the interface of the
            # address this node gave the cluster, which the other ranks reach.
            interface = interface_of(host_of(self.node.address))
            if interface is not None:
                os.environ["GLOO_SOCKET_IFNAME"] = interface
        store = dist.TCPStore(
            self.spec.store_host,
            self.spec.store_port,
            is_master=False,
            timeout=datetime.timedelta(seconds=cfg.start_timeout_s),
        )
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(self.spec.group, store),
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=cfg.operation_timeout_s),
        )
        # A first collective: a group that cannot talk (a firewall, a wrong interface) fails now,
        # within trainer.start_timeout_s, not at the first step.
        dist.all_reduce(torch.zeros(1, device=self.device))
        return {"rank": self.rank, "pid": os.getpid(), "backend": backend, "node": self.node.node_id}

    @endpoint
    async def load(self, model_dir: str, total_steps: int) -> dict[str, Any]:
        return dict(await self._run(self._load, model_dir, total_steps))

    def _load(self, model_dir: str, total_steps: int) -> dict[str, Any]:
        from transformers.utils import logging as hf_logging

        from ..models import load_pretrained_dir

        hf_logging.disable_progress_bar()  # a rank's output is the run's log: no bar per load and per checkpoint
        model, _ = load_pretrained_dir(model_dir, device=str(self.device))
        self.trainer = PolicyTrainer(model, self.config, total_steps=total_steps)
        gc.freeze()  # start-up's objects live as long as the rank: full collections never rescan them
        return {"parameters": sum(p.numel() for p in model.parameters()), "device": str(self.device)}

    @endpoint
    async def shutdown(self) -> None:
        """Remove the shared-memory file and leave the group. Idempotent; never waits for a
        thread stuck in a collective (the process exits without it)."""
        if self._closed:
            return
        self._closed = True
        if self.shared is not None:
            self.shared.close()
        sending = self.senders is not None and self.senders.busy
        if self.senders is not None:
            self.senders.close()
        if self._thread.busy or sending:
            # Inside a collective whose peer is gone: it ends only at its deadline. This process
            # is the rank's alone, so it exits without it, and without running the C++
            # destructors that would abort on the still-running collective.
            log.warning(
                "trainer rank %d stops while its thread is inside a collective; the process exits without waiting for it",
                self.rank,
            )
            atexit.register(_exit_now)
        elif dist.is_initialized():
            try:
                await asyncio.wait_for(self._thread.submit(dist.destroy_process_group), 10.0)
            except (TimeoutError, Exception) as exc:  # leaving is best effort: the process ends next
                log.warning("trainer rank %d: leaving its group failed: %s", self.rank, exc)
        self._thread.stop()

    @endpoint
    async def ping(self) -> int:
        return os.getpid()

    # -- training -----------------------------------------------------------------------------
    @endpoint
    async def step(
        self, batch: dict[str, Any], temperature: float, denominator: float, micro_batches: int
    ) -> dict[str, float]:
        return dict(await self._run(self._step, batch, temperature, denominator, micro_batches))

    def _step(
        self, batch: dict[str, Any], temperature: float, denominator: float, micro_batches: int
    ) -> dict[str, float]:
        rows = TrainBatch.from_tensors(batch)
        if self.shared is not None:
            self.shared.invalidate()  # the parameters in shared memory change now: no engine may copy them
        started = time.perf_counter()
        metrics = self._trainer().step(
            rows, temperature=temperature, denominator=denominator, micro_batches=micro_batches
        )
        return {**metrics, "compute_s_max": time.perf_counter() - started}  # max over ranks: REDUCTIONS

    @endpoint
    async def logprobs(
        self, batch: dict[str, Any], temperature: float, micro_batches: int, reference: bool = False
    ) -> Any:
        return await self._run(self._logprobs, batch, temperature, micro_batches, reference)

    def _logprobs(
        self, batch: dict[str, Any], temperature: float, micro_batches: int, reference: bool
    ) -> Any:
        trainer, rows = self._trainer(), TrainBatch.from_tensors(batch)
        return (
            trainer.reference_logprobs(rows, temperature)
            if reference
            else trainer.compute_logprobs(rows, temperature, micro_batches=micro_batches)
        )

    @endpoint
    async def weights(self) -> dict[str, Any] | None:
        """The parameters by name, whole, on the CPU: from rank 0 (every rank takes part in gathering shards)."""
        return await self._run(self._weights)

    def _weights(self) -> dict[str, Any] | None:
        weights = self._trainer().weights()
        return weights if self.rank == 0 else None

    # -- weight sync (rank 0 sends; the others take part in gathering sharded parameters) -------
    @endpoint
    async def weight_plan(self, bucket_bytes: int, alone_bytes: int) -> bytes:
        """The bucket plan of what a sync sends (names, shapes, dtypes: the parameters, or the
        LoRA adapters with the scale engines apply them by), as msgpack."""
        from ..weights import plan_buckets

        layout, scale = self._trainer().weight_layout(), self._trainer().sync_scale
        return msgspec.msgpack.encode(
            plan_buckets(layout, bucket_bytes, alone_bytes=alone_bytes, lora_scale=scale)
        )

    @endpoint
    async def share_weights(
        self, directory: str, plan: bytes, slots: int = 1, host: bool = False
    ) -> list[Any] | None:
        """Rank 0 on a CPU (on a GPU too with ``host``: ``weights.transport=shm``, the same-device
        path of ``cluster.colocate``): a shared-memory file in ``directory`` engines on this machine
        copy versions from, and return its ``ShmOffer``; else None. One slot: CPU parameters live
        in it. More: it is the relay (``weights.max_live_versions``), each version a snapshot."""
        if self.rank != 0:
            return None
        return await self._run(self._share_weights, directory, plan, slots, host)

    def _share_weights(self, directory: str, plan: bytes, slots: int, host: bool) -> list[Any] | None:
        from ..weights import BucketPlan, SharedWeights, flat_layout

        trainer = self._trainer()
        if self.device.type != "cpu" and not host:
            return None  # GPU parameters: NCCL is the fast path
        if self.shared is not None:
            self.shared.close()
        self.shared = SharedWeights.create(
            directory, msgspec.msgpack.decode(plan, type=BucketPlan), slots=slots
        )
        # The optimizer then updates the parameters in the file itself.
        if trainer.sends_parameters and slots == 1 and self.device.type == "cpu":
            self.flat = flat_layout(
                self.shared.plan, dict(trainer.model.named_parameters()), out=self.shared.data
            )
        return list(msgspec.to_builtins(self.shared.offer))

    @endpoint
    async def weight_backend(self) -> str:
        """The weight group's backend this rank's parameters call for: NCCL on a GPU, else gloo."""
        return "nccl" if self.device.type == "cuda" else "gloo"

    @endpoint
    async def weight_store(self, host: str = "") -> list[Any]:
        """Rank 0 hosts the weight group's rendezvous store (once; later generations reuse it) and
        returns ``[host, port]`` for the engines: ``host``, else this node's address. (The store
        listens on every interface; the host it is created with is only its own client's.)"""
        if self.weight_group_store is None:
            self.weight_group_store = await asyncio.to_thread(
                dist.TCPStore,
                "127.0.0.1",
                0,
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=self.config.start_timeout_s),
            )
        return [host or host_of(self.node.address), int(self.weight_group_store.port)]

    @endpoint
    async def join_weights(self, address: GroupAddress, plan: bytes) -> None:
        """Rank 0 becomes rank 0 of a weight group at ``address``: one engine's pair group
        (``address.peer``), or the group of every broadcast engine (NCCL). ``address.size`` 1:
        no engine takes the broadcast (all copy from shared memory). The group forms off the
        training thread, so an engine slow to join never holds a step."""
        if self.rank != 0:
            return
        if address.backend == "nccl" and self.device.type != "cuda":
            raise ValueError("weights.backend=nccl needs the trainer on a GPU")
        backend = address.backend or ("nccl" if self.device.type == "cuda" else "gloo")
        await self._run(self._lay_out_weights, plan)
        if address.size > 1:
            if self.weight_group_store is None:
                raise RuntimeError(
                    "join_weights before weight_store: the synchroniser asks for the store first"
                )
            # Rank 0 hosts the store: it joins through the one it holds, not over the address.
            await asyncio.to_thread(
                self.senders.join,
                msgspec.structs.replace(address, backend=backend),
                store=self.weight_group_store,
                local_host=host_of(self.node.address),
            )

    def _lay_out_weights(self, plan: bytes) -> None:
        from ..weights import BucketPlan, flat_layout
        from ..weights.fanout import PeerSenders

        if self.senders is None:
            bucket_plan = msgspec.msgpack.decode(plan, type=BucketPlan)
            self.senders = PeerSenders(bucket_plan, device=self.device)
            trainer = self._trainer()
            if trainer.sends_parameters and self.device.type == "cpu" and self.flat is None:
                # Parameters move into one buffer laid out as the buckets: each bucket is then sent
                # straight from the parameters' memory (no packing copy).
                self.flat = flat_layout(bucket_plan, dict(trainer.model.named_parameters()))

    @endpoint
    async def drop_weights(self, peer: str) -> None:
        """Let go of ``peer``'s pair group: the engine left rotation."""
        if self.senders is not None:
            self.senders.drop(peer)

    @endpoint
    async def send_weights(self, version: int, peers: list[str] | None = None) -> float:
        """Publish the current parameters as ``version``: into shared memory (if offered) and to
        the engines that take the broadcast (``peers``: only those), each pair on its own thread;
        returns rank 0's seconds, which do not wait for the pairs."""
        return float(await self._run(self._send_weights, version, peers))

    def _send_weights(self, version: int, peers: list[str] | None) -> float:
        weights = self._trainer().sync_tensors()  # every rank: gathering shards is collective
        if self.rank != 0:
            return 0.0
        started = time.perf_counter()
        if self.shared is not None and self.shared.slots > 1:  # the relay: a snapshot, sent from there
            from ..weights import fill_flat

            flat, plan, shared = self.flat, self.shared.plan, self.shared
            shared.hold(
                version,
                lambda out: out.copy_(flat) if flat is not None else fill_flat(plan, weights, out),
                wait_s=self.config.operation_timeout_s,
            )
            if self.senders and peers != []:
                self._relay_weights(version, peers)
            return time.perf_counter() - started
        if self.shared is not None:
            from ..weights import fill_flat

            fill_flat(self.shared.plan, weights, self.shared.data)  # no copy when already laid out there
            self.shared.publish(version)
        if self.senders:
            self.senders.post(weights, version, peers)
        elif self.shared is None:
            raise RuntimeError("no weight group and no shared memory: call join_weights first")
        return time.perf_counter() - started

    @endpoint
    async def relay_weights(self, version: int, peers: list[str] | None = None) -> None:
        """Send ``version`` from the relay to the pair groups of ``peers`` (default: all), off the
        training thread (the trainer's parameters are not read): how an engine pulls a version
        it asks for, or is sent one again. ``SyncError`` if the relay no longer holds it."""
        if self.rank != 0:
            return
        if self.shared is None or self.shared.slots < 2 or not self.senders:
            raise RuntimeError(
                "relay_weights needs the relay (weights.max_live_versions >= 2) and a pair group"
            )
        self._relay_weights(version, peers)

    def _relay_weights(self, version: int, peers: list[str] | None) -> None:
        from ..weights import flat_views

        assert self.shared is not None and self.senders is not None
        shared = self.shared
        slot, release = shared.pin(version)  # held while the sends are posted
        try:
            self.senders.post(
                flat_views(shared.plan, slot), version, peers, pin=lambda: shared.pin(version)[1]
            )
        finally:
            release()

    # -- checkpoints --------------------------------------------------------------------------
    @endpoint
    async def save(self, folder: str, background: bool = False) -> None:
        """Take the state now (on the training thread: gathering shards is collective) and write
        it into ``folder``; ``background``: the files are written while the next steps run
        (``saved`` waits for them)."""
        await self.saved()  # one checkpoint at a time
        state = await self._run(self._state_to_save)
        writing = in_background(self._write, folder, *state)
        if background:
            self._writing = writing
        else:
            await writing

    @endpoint
    async def saved(self) -> None:
        """Wait until the checkpoint being written is on disk (its error, if it failed)."""
        writing, self._writing = self._writing, None
        if writing is not None:
            await writing

    def _state_to_save(self) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        return self._trainer().state_to_save(keep=self.rank == 0), rng_state()

    def _write(self, folder: str, state: dict[str, Any] | None, rng: dict[str, Any]) -> None:
        path = Path(folder)
        if state is not None:
            self._trainer().write_saved(path, state)
        torch.save(rng, path / f"rng_rank{self.rank}.pt")

    @endpoint
    async def load_checkpoint(self, folder: str) -> int:
        return int(await self._run(self._load_checkpoint, folder))

    def _load_checkpoint(self, folder: str) -> int:
        path = Path(folder)
        if self.shared is not None:
            self.shared.invalidate()
        self._trainer().load(path)
        rng = path / f"rng_rank{self.rank}.pt"
        if rng.is_file():
            set_rng_state(torch.load(rng, weights_only=False))
        return self._trainer().steps


def _exit_now() -> None:
    """The process's last act (registered last, run first at exit): flush and leave."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


__all__ = ["GroupBroken", "RankSpec", "TrainerRank", "pick_device"]
