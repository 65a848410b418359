"""The trainer: N data-parallel ``TrainerRank`` actors on any nodes, driven as one.

    async with TrainerActor(TrainerConfig(world_size=2), node=cluster.head, hosts=["node-0", "node-1"]) as trainer:
        await trainer.start(model_dir, total_steps=100)
        metrics = await trainer.step(TrainBatch.from_rollout(batch, advantages), temperature=1.0)
        engine_weights = await trainer.weights()

Each rank runs in a process that its host node starts and supervises (``Node.start_child``);
without a ``node`` the trainer starts a one-node cluster of its own in this process and every
rank runs beside it, the local default. Each call goes to every rank (they are collective): the
batch is split into row shards of nearly equal tokens (``trainer.balance_batch``), one per rank,
and every shard's loss is normalised by the whole batch's denominator, so the summed gradients,
hence the step, do not depend on ``world_size``. Calls reach the ranks through the actor
runtime; the ranks talk to each other over torch.distributed (gloo on CPU, NCCL on GPU),
meeting at a TCP store this driver hosts at the head's address (or at
``MASTER_ADDR:MASTER_PORT`` when those are set, as under torchrun).

Nothing waits without a deadline: starting has ``trainer.start_timeout_s``, each call to the
ranks ``trainer.operation_timeout_s``. A rank whose node is lost, or whose group broke in a
collective, fails the call with ``RankLostError`` as soon as the runtime knows; a rank that
fails while its peers stay in a collective marks the trainer unusable after 5 s. Shutdown:
every rank leaves its group, then their processes stop; ``close()`` is idempotent.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..config.train import TrainerConfig
from ..runtime import ActorNotFound, CallTimeout, LocalCluster, Node, NodeLostError
from ..runtime.address import host_of
from ..runtime.events import emit
from ..runtime.rendezvous import master_address, master_store
from ..weights.errors import raised_remotely
from ..weights.protocol import GroupAddress
from .rank import GroupBroken, RankSpec, TrainerRank
from .types import TrainBatch, balanced_shards, micro_plan, reduce_metrics, shard_rows

log = logging.getLogger(__name__)


STRAGGLER_GRACE_S = 5.0  # after one rank fails a call, how long the others may take to fail too


class RankLostError(NodeLostError):
    """A trainer rank's node was lost, or the rank failed while its peers waited for it in a
    collective: the trainer cannot continue (start a new one from a checkpoint)."""

    def __init__(self, message: str) -> None:
        self.node = "trainer"
        Exception.__init__(self, message)


class TrainerActor:
    """The driver of ``config.world_size`` ranks placed on ``hosts`` (node ids or ranks, one per
    trainer rank; default: all on ``node``). ``node``: this process's node of the cluster (the
    head); None starts a private one-node cluster for the ranks."""

    def __init__(
        self,
        config: TrainerConfig | None = None,
        *,
        node: Node | None = None,
        hosts: Sequence[int | str] | None = None,
        devices: Sequence[int] | None = None,
    ) -> None:
        self.config = config or TrainerConfig()
        self.world_size = self.config.world_size
        placed = (
            list(hosts)
            if hosts is not None
            else [node.node_id if node is not None else "node-0"] * self.world_size
        )
        if len(placed) != self.world_size:
            raise ValueError(
                f"trainer.world_size={self.world_size} ranks need as many hosts, got {len(placed)} ({placed})"
            )
        self.hosts = [f"node-{h}" if isinstance(h, int) else h for h in placed]
        # A rank's GPU on its machine: by default its index among the ranks its node hosts (the
        # placement passes its own, which counts the machine's engines and every node on it).
        self.devices = (
            list(devices)
            if devices is not None
            else [self.hosts[:r].count(h) for r, h in enumerate(self.hosts)]
        )
        self._node = node
        self._own: LocalCluster | None = None
        self._store: Any = None  # the rendezvous TCP store, when hosted here
        self.ranks: list[TrainerRank] = []  # refs: their endpoints type-check as TrainerRank's
        self.processes: list[str] = []  # node ids of the ranks' processes
        self._shared_files: list[
            str
        ] = []  # rank 0's shared-memory weights: removed here too, should it be killed
        self._closed = False
        self._broken = ""
        self.info: dict[str, Any] = {}

    async def __aenter__(self) -> TrainerActor:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self, model_dir: str | os.PathLike[str], *, total_steps: int = 1) -> None:
        """Start a process per rank on its host node, form the group, load ``model_dir`` on each
        (deadlines: ``trainer.start_timeout_s``): ``form()`` then ``load_model()``."""
        await self.form()
        await self.load_model(model_dir, total_steps=total_steps)

    async def form(self) -> None:
        """Start a process per rank on its host node and form the group: a first collective, so a
        group that cannot talk fails here, in seconds, before anything heavy loads (deadline:
        ``trainer.start_timeout_s``)."""
        if self.ranks or self._closed:
            raise RuntimeError("the trainer is already started" if self.ranks else "the trainer is closed")
        cfg = self.config
        node = self._node
        if node is None:
            self._own = LocalCluster(nodes=1)
            await self._own.__aenter__()
            node = self._node = self._own.head
        host, port = self._rendezvous(node)
        group = f"rlasync/trainer/{uuid.uuid4().hex[:12]}"
        tag = group.rsplit("/", 1)[-1][:6]
        try:
            async with asyncio.timeout(cfg.start_timeout_s):
                children = await asyncio.gather(
                    *[node.start_child(preload=("rlasync.trainer.rank",), on=h) for h in self.hosts]
                )
                self.processes = [child.node_id for child in children]
                needed = max(self.devices) + 1  # every rank decides trainer.device=auto alike
                specs = [
                    RankSpec(
                        rank=r,
                        world_size=self.world_size,
                        store_host=host,
                        store_port=port,
                        group=group,
                        device_index=self.devices[r],
                        devices_needed=needed,
                        config=cfg,
                    )
                    for r in range(self.world_size)
                ]
                self.ranks = list(
                    await asyncio.gather(
                        *[
                            node.spawn(
                                TrainerRank, spec, node=child.node_id, name=f"trainer-{tag}-rank{spec.rank}"
                            )
                            for spec, child in zip(specs, children)
                        ]
                    )
                )
        except TimeoutError:
            raise CallTimeout(
                f"the trainer's {self.world_size} rank processes did not start within trainer.start_timeout_s={cfg.start_timeout_s:g}s"
            ) from None
        hellos = await self._call_all(
            "join", [[]] * self.world_size, timeout=cfg.start_timeout_s, setting="trainer.start_timeout_s"
        )
        emit(
            "trainer", ranks=self.world_size, backend=hellos[0]["backend"], nodes=self.processes
        )  # the group did its first collective
        self.info = {
            "backend": hellos[0]["backend"],
            "pids": [h["pid"] for h in hellos],
            "nodes": self.processes,
        }

    async def load_model(self, model_dir: str | os.PathLike[str], *, total_steps: int = 1) -> None:
        """Load ``model_dir`` on every rank of the formed group, with an optimiser (and schedule)
        for ``total_steps`` updates (deadline: ``trainer.start_timeout_s``)."""
        if not self.info:
            raise RuntimeError("form() the trainer's group before loading a model")
        cfg = self.config
        loaded = await self._call_all(
            "load",
            [[str(model_dir), total_steps]] * self.world_size,
            timeout=cfg.start_timeout_s,
            setting="trainer.start_timeout_s",
        )
        self.info.update(loaded[0])
        log.info(
            "trainer: %d rank(s) on %s (%s, %s), %d parameters",
            self.world_size,
            ", ".join(self.processes),
            self.info["device"],
            self.info["backend"],
            self.info["parameters"],
        )

    def _rendezvous(self, node: Node) -> tuple[str, int]:
        """Where the ranks meet: ``MASTER_ADDR:MASTER_PORT`` when set (torchrun's agent hosts the
        store there, or the head's process does: ``runtime.rendezvous``), else a store hosted
        here at the head's address."""
        master = master_address()
        if master is not None:
            try:
                self._store = master_store(self.config.start_timeout_s)
            except RuntimeError as exc:
                raise RuntimeError(f"the trainer's rendezvous: {exc}") from None
            return master
        timeout = datetime.timedelta(seconds=self.config.start_timeout_s)
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
        return host_of(node.address), int(self._store.port)

    async def close(self) -> None:
        """Every rank leaves its group, then the ranks' processes stop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        node = self._node
        if self.ranks:
            await asyncio.gather(
                *[ref.shutdown.options(timeout=15.0)() for ref in self.ranks], return_exceptions=True
            )
        if node is not None and self.processes:
            await node.stop_nodes(self.processes)
        if self._own is not None:
            await self._own.close()
        self._store = None
        for path in self._shared_files:
            Path(path).unlink(missing_ok=True)

    # -- endpoints ------------------------------------------------------------------------
    async def step(self, batch: TrainBatch, *, temperature: float = 1.0) -> dict[str, float]:
        """One optimiser step on ``batch``, split over the ranks. Metrics are reduced over the
        ranks once, each as ``rlasync.metrics.REDUCTIONS`` declares (else token-weighted)."""
        if self.config.strategy == "fsdp2" and batch.size < self.world_size:
            raise ValueError(
                f"trainer.strategy=fsdp2 needs a row per rank: a batch of {batch.size} for {self.world_size} ranks"
            )
        denominator = batch.loss_denominator(self.config.loss_agg)
        shards = self._shards(batch)
        args = [
            [batch.rows(rows).tensors(), temperature, denominator, self._micro_batches(batch, shards)]
            for rows in shards
        ]
        replies = await self._call_all("step", args)
        merged = reduce_metrics(
            [
                (r["tokens"], {k: v for k, v in r.items() if k not in ("tokens", "grad_norm", "lr")})
                for r in replies
            ]
        )
        merged.update(
            tokens=sum(r["tokens"] for r in replies), grad_norm=replies[0]["grad_norm"], lr=replies[0]["lr"]
        )
        return merged

    async def compute_logprobs(
        self, batch: TrainBatch, *, temperature: float = 1.0, reference: bool = False
    ) -> Any:
        """``[B, R]`` logprobs of ``batch``'s responses under the current parameters, or under
        the frozen reference policy (``reference``; needs ``trainer.kl_coef > 0``)."""
        import torch

        shards = self._shards(batch)
        count = self._micro_batches(batch, shards)
        parts = await self._call_all(
            "logprobs", [[batch.rows(rows).tensors(), temperature, count, reference] for rows in shards]
        )
        sent = torch.cat(parts)  # the ranks' rows one after the other: back to the batch's order
        gathered = torch.empty_like(sent)
        gathered[torch.cat([torch.arange(batch.size)[rows] for rows in shards])] = sent
        return gathered

    async def weights(self) -> dict[str, Any]:
        """The parameters by name, whole, on the CPU (gathered by rank 0)."""
        return dict((await self._call_all("weights", [[]] * self.world_size))[0])

    # -- weight sync: the sending side of rlasync.weights.ParameterSynchronizer ---------------
    async def weight_plan(self, bucket_bytes: int, alone_bytes: int) -> bytes:
        return bytes((await self._call_ranks({0: [bucket_bytes, alone_bytes]}, "weight_plan"))[0])

    async def share_weights(self, directory: str, plan: bytes, slots: int = 1, host: bool = False) -> Any:
        """Rank 0 makes a shared-memory file in ``directory`` for engines on its machine (its
        parameters' home with one slot, its relay with more); returns the offer to send them
        (None on GPUs, unless ``host``: ``weights.transport=shm``)."""
        offer = (await self._call_ranks({0: [directory, plan, slots, host]}, "share_weights"))[0]
        if offer is not None:
            self._shared_files.append(str(offer[0]))
        return offer

    async def weight_backend(self) -> str:
        """``nccl`` when rank 0's parameters are on a GPU, else ``gloo`` (``weights.backend=auto``)."""
        return str((await self._call_ranks({0: []}, "weight_backend"))[0])

    async def weight_store(self, host: str = "") -> tuple[str, int]:
        """Where the weight group meets: a store rank 0 hosts, at ``host`` or its node's address."""
        address = (await self._call_ranks({0: [host]}, "weight_store"))[0]
        return str(address[0]), int(address[1])

    async def join_weights(self, address: GroupAddress, plan: bytes) -> None:
        """Rank 0 becomes rank 0 of a weight group at ``address`` (one engine's pair group, or
        the group of every broadcast engine)."""
        await self._call_ranks({0: [address, plan]}, "join_weights", timeout=address.timeout_s + 5.0)

    async def drop_weights(self, peer: str) -> None:
        """Rank 0 lets go of ``peer``'s pair group (the engine left rotation)."""
        await self._call_ranks({0: [peer]}, "drop_weights")

    async def send_weights(self, version: int, peers: list[str] | None = None) -> float:
        """Publish ``version`` (to ``peers`` only, if named); does not wait for pair groups' sends."""
        return float((await self._call_all("send_weights", [[version, peers]] * self.world_size))[0])

    async def relay_weights(self, version: int, peers: list[str] | None = None) -> None:
        """Rank 0 sends ``version`` from its relay to the pair groups of ``peers`` (all if None),
        without touching the parameters: an engine pulling it, or a send tried again."""
        await self._call_ranks({0: [version, peers]}, "relay_weights")

    def _shards(self, batch: TrainBatch) -> list[Any]:
        """Each rank's rows: index tensors balanced by tokens, or contiguous slices."""
        if self.config.balance_batch and self.world_size > 1:
            return balanced_shards(batch.attention_mask.sum(-1).tolist(), self.world_size)
        return shard_rows(batch.size, self.world_size)

    def _micro_batches(self, batch: TrainBatch, shards: list[Any]) -> int:
        """The most micro-batches any rank runs: FSDP2 ranks all run that many (each forward
        gathers parameters collectively). DDP ranks run their own, so 0: no pass over the
        batch here that each rank makes again."""
        cfg = self.config
        if cfg.strategy != "fsdp2" or self.world_size == 1:
            return 0
        return max(
            len(micro_plan(batch.rows(s), cfg.micro_batch_size, cfg.micro_batch_tokens)) for s in shards
        )

    async def save(self, folder: str | os.PathLike[str], *, background: bool = False) -> None:
        """Write the model (Hugging Face folder, safetensors), optimiser, scheduler and every
        rank's RNG state into ``folder`` (which must be visible to every rank). ``background``:
        return once the state is taken (copies); the ranks write it while they go on training,
        and ``saved()`` waits until it is on disk."""
        Path(folder).mkdir(parents=True, exist_ok=True)
        await self._call_all("save", [[str(folder), background]] * self.world_size)

    async def saved(self) -> None:
        """Wait until the checkpoint ``save(background=True)`` started is written."""
        await self._call_all("saved", [[]] * self.world_size)

    async def load(self, folder: str | os.PathLike[str]) -> int:
        """Restore what ``save`` wrote; returns the trainer's step count."""
        steps = await self._call_all("load_checkpoint", [[str(folder)]] * self.world_size)
        return int(steps[0])

    # -- plumbing -------------------------------------------------------------------------
    async def _call_all(
        self,
        method: str,
        per_rank: list[list[Any]],
        *,
        timeout: float | None = None,
        setting: str = "trainer.operation_timeout_s",
    ) -> list[Any]:
        return await self._call_ranks(dict(enumerate(per_rank)), method, timeout=timeout, setting=setting)

    async def _call_ranks(
        self,
        per_rank: dict[int, list[Any]],
        method: str,
        *,
        timeout: float | None = None,
        setting: str = "trainer.operation_timeout_s",
    ) -> list[Any]:
        """``method`` on the given ranks, concurrently: their answers in rank order, unless a rank
        is lost, its group broke, a rank fails while others stay in a collective, or the deadline
        (``timeout``, default ``trainer.operation_timeout_s``) passes first."""
        if self._closed or not self.ranks:
            raise RuntimeError(
                "the trainer is not running: call start() first"
                if not self._closed
                else "the trainer is closed"
            )
        if self._broken:
            raise RankLostError(f"the trainer is unusable ({self._broken}): restart it from a checkpoint")
        deadline = timeout or self.config.operation_timeout_s
        calls = {
            r: asyncio.ensure_future(getattr(self.ranks[r], method).options(timeout=deadline)(*args))
            for r, args in per_rank.items()
        }
        first_error: tuple[int, BaseException] | None = None
        loop = asyncio.get_running_loop()
        failed_at = 0.0
        try:
            while True:
                for r, call in calls.items():
                    if not call.done() or call.exception() is None:
                        continue
                    error = call.exception()
                    assert error is not None
                    if _lost(error):
                        self._broken = f"trainer rank {r} ({self.processes[r]}) was lost during {method}"
                        raise RankLostError(f"{self._broken}: {error}") from error
                    if isinstance(error, CallTimeout):
                        raise CallTimeout(
                            f"trainer {method}: rank {r} gave no answer within {deadline:g}s; raise {setting} if the work is just slow"
                        ) from None
                    if first_error is None:
                        first_error, failed_at = (r, error), loop.time()
                pending = [c for c in calls.values() if not c.done()]
                if not pending:
                    if first_error is not None:
                        raise first_error[1]
                    return [calls[r].result() for r in sorted(calls)]
                if first_error is not None and loop.time() - failed_at > STRAGGLER_GRACE_S:
                    # Some ranks failed and others did not answer: those are waiting in a
                    # collective for the failed ones and never will, so the group is unusable.
                    self._broken = f"trainer rank {first_error[0]} failed during {method} while others waited in a collective"
                    raise RankLostError(f"{self._broken}: {first_error[1]}") from first_error[1]
                wait = STRAGGLER_GRACE_S + 0.05 if first_error is not None else None
                await asyncio.wait(pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for call in calls.values():
                if not call.done():
                    call.cancel()  # tells that rank's node to stop serving it


def _lost(error: BaseException) -> bool:
    """The rank's process is gone, or its group can no longer be used: the rank raised
    ``GroupBroken`` (or torch.distributed's own error, should one get past it)."""
    if isinstance(error, (NodeLostError, ActorNotFound)):
        return True
    return raised_remotely(error, GroupBroken, dist.DistBackendError, dist.DistNetworkError)


__all__ = ["RankLostError", "TrainerActor"]
