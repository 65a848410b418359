"""The trainer actor: N data-parallel torch.distributed ranks, each a process it starts and owns.

    async with TrainerActor(TrainerConfig(world_size=2)) as trainer:
        await trainer.start(model_dir, total_steps=100)
        metrics = await trainer.step(TrainBatch.from_rollout(batch, advantages), temperature=1.0)
        engine_weights = await trainer.weights()

Each call goes to every rank (they are collective); the batch is split into contiguous row
shards, one per rank, and every shard's loss is normalised by the whole batch's denominator,
so the summed gradients, hence the step, do not depend on ``world_size``. Ranks talk to the
actor over ZeroMQ (ipc) with the runtime's codec, and to each other over torch.distributed
(gloo on CPU, NCCL on GPU; a file store in the actor's folder is the rendezvous).

Nothing waits without a deadline: starting has ``trainer.start_timeout_s``, each call
``trainer.call_timeout_s``, and a rank process that exits fails the call at once with
``RankLostError`` (its log's last lines included). Shutdown order: ask every rank to stop,
wait briefly, then terminate what is left; ``close()`` is idempotent, and a rank whose actor
process dies exits by itself within a second.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from ..config.train import TrainerConfig
from ..runtime.errors import ActorError, CallTimeout, NodeLostError
from ..transport.codec import Codec, DecodeError
from ..transport.messages import Call, Error, Reply
from .types import TrainBatch, micro_plan, reduce_metrics, shard_rows

log = logging.getLogger(__name__)


STRAGGLER_GRACE_S = 5.0  # after one rank fails a call, how long the others may take to fail too


class RankLostError(NodeLostError):
    """A trainer rank exited, or failed while its peers waited for it in a collective: the
    trainer cannot continue (start a new one from a checkpoint)."""

    def __init__(self, message: str) -> None:
        self.node = "trainer"
        Exception.__init__(self, message)


class TrainerActor:
    def __init__(self, config: TrainerConfig | None = None, *, log_dir: str | os.PathLike[str] | None = None) -> None:
        self.config = config or TrainerConfig()
        self.world_size = self.config.world_size
        self._folder = Path(tempfile.mkdtemp(prefix="rlasync-trainer-"))
        self._log_dir = Path(log_dir) if log_dir is not None else self._folder
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: Any = None
        self._codec = Codec()
        self._procs: list[subprocess.Popen[bytes]] = []
        self._pending: dict[tuple[int, int], tuple[str, asyncio.Future[Any]]] = {}
        self._hello: dict[int, asyncio.Future[Any]] = {}
        self._receiver: asyncio.Task[None] | None = None
        self._next_id = 0
        self._shared_files: list[str] = []  # rank 0's shared-memory weights: removed here too, should it be killed
        self._closed = False
        self._broken = ""
        self.info: dict[str, Any] = {}

    async def __aenter__(self) -> TrainerActor:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self, model_dir: str | os.PathLike[str], *, total_steps: int = 1) -> None:
        """Start the ranks, join their group, load ``model_dir`` on each (deadline: ``trainer.start_timeout_s``)."""
        if self._procs:
            raise RuntimeError("the trainer actor is already started")
        cfg = self.config
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        address = f"ipc://{self._folder}/control.sock"
        self._sock.bind(address)
        loop = asyncio.get_running_loop()
        self._hello = {rank: loop.create_future() for rank in range(self.world_size)}
        self._receiver = asyncio.create_task(self._receive(), name="trainer-actor-receiver")
        self._log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        if cfg.threads:
            env["OMP_NUM_THREADS"] = str(cfg.threads)
        for rank in range(self.world_size):
            log_file = (self._log_dir / f"trainer_rank{rank}.log").open("ab")
            command = [
                sys.executable, "-m", "rlasync.trainer.rank", f"--rank={rank}", f"--world-size={self.world_size}",
                f"--controller={address}", f"--init-method=file://{self._folder}/rendezvous", f"--device={cfg.device}",
                f"--threads={cfg.threads}", f"--collective-timeout-s={cfg.call_timeout_s}", f"--cpus={','.join(map(str, cfg.cpu_affinity))}",
            ]  # fmt: skip
            self._procs.append(subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL))
            log_file.close()  # the child holds its own descriptor
        deadline = time.monotonic() + cfg.start_timeout_s
        hellos = await self._wait(list(self._hello.values()), deadline, "start", "trainer.start_timeout_s")
        self.info = {"backend": hellos[0]["backend"], "pids": [h["pid"] for h in hellos]}
        loaded = await self._call_all("load", [[str(model_dir), msgspec.to_builtins(cfg), total_steps]] * self.world_size, deadline=deadline, setting="trainer.start_timeout_s")
        self.info.update(loaded[0])
        log.info("trainer actor: %d rank(s) on %s (%s), %d parameters", self.world_size, self.info["device"], self.info["backend"], self.info["parameters"])

    async def close(self) -> None:
        """Stop the ranks (politely, then by signal) and release the socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        live = [rank for rank, proc in enumerate(self._procs) if proc.poll() is None]
        if live and self._sock is not None:
            for rank in live:
                self._send(rank, Call(id=self._new_id(), actor="trainer", method="shutdown"))
        ends = time.monotonic() + 10.0
        while any(proc.poll() is None for proc in self._procs) and time.monotonic() < ends:
            await asyncio.sleep(0.05)
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                await asyncio.to_thread(proc.wait, 5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self._receiver is not None:
            self._receiver.cancel()
            await asyncio.wait([self._receiver])  # its end, not its CancelledError (ours still propagates)
        self._pending.clear()  # a caller still waiting sees its ranks gone (RankLostError)
        if self._sock is not None:
            self._sock.close(0)
        if self._ctx is not None:
            self._ctx.term()
        shutil.rmtree(self._folder, ignore_errors=True)
        for path in self._shared_files:
            Path(path).unlink(missing_ok=True)

    # -- endpoints ------------------------------------------------------------------------
    async def step(self, batch: TrainBatch, *, temperature: float = 1.0) -> dict[str, float]:
        """One optimiser step on ``batch``, split over the ranks. Metrics are reduced over the
        ranks once (token-weighted; ``*_min``/``*_max`` by min/max)."""
        if self.config.strategy == "fsdp2" and batch.size < self.world_size:
            raise ValueError(f"trainer.strategy=fsdp2 needs a row per rank: a batch of {batch.size} for {self.world_size} ranks")
        denominator = batch.loss_denominator(self.config.loss_agg)
        shards = shard_rows(batch.size, self.world_size)
        args = [[batch.rows(rows).tensors(), temperature, denominator, self._micro_batches(batch, shards)] for rows in shards]
        replies = await self._call_all("step", args)
        merged = reduce_metrics([(r["tokens"], {k: v for k, v in r.items() if k not in ("tokens", "grad_norm", "lr")}) for r in replies])
        merged.update(tokens=sum(r["tokens"] for r in replies), grad_norm=replies[0]["grad_norm"], lr=replies[0]["lr"])
        return merged

    async def compute_logprobs(self, batch: TrainBatch, *, temperature: float = 1.0, reference: bool = False) -> Any:
        """``[B, R]`` logprobs of ``batch``'s responses under the current parameters, or under
        the frozen reference policy (``reference``; needs ``trainer.kl_coef > 0``)."""
        import torch

        shards = shard_rows(batch.size, self.world_size)
        count = self._micro_batches(batch, shards)
        parts = await self._call_all("logprobs", [[batch.rows(rows).tensors(), temperature, count, reference] for rows in shards])
        return torch.cat(parts)

    async def weights(self) -> dict[str, Any]:
        """The parameters by name, whole, on the CPU (gathered by rank 0)."""
        return dict((await self._call_all("weights", [[]] * self.world_size))[0])

    # -- weight sync: the sending side of rlasync.weights.ParameterSynchronizer ---------------
    async def weight_plan(self, bucket_bytes: int, alone_bytes: int) -> bytes:
        return bytes((await self._call_ranks({0: [bucket_bytes, alone_bytes]}, "weight_plan"))[0])

    async def share_weights(self, directory: str, plan: bytes) -> Any:
        """Rank 0 lays its parameters out in a shared-memory file in ``directory`` for engines
        on this machine; returns the offer to send them (None on GPUs)."""
        offer = (await self._call_ranks({0: [directory, plan]}, "share_weights"))[0]
        if offer is not None:
            self._shared_files.append(str(offer[0]))
        return offer

    async def weight_backend(self) -> str:
        """``nccl`` when rank 0's parameters are on a GPU, else ``gloo`` (``weights.backend=auto``)."""
        return str((await self._call_ranks({0: []}, "weight_backend"))[0])

    async def join_weights(self, host: str, port: int, size: int, timeout_s: float, generation: int, plan: bytes, backend: str = "") -> None:
        await self._call_ranks({0: [host, port, size, timeout_s, generation, plan, backend]}, "join_weights")

    async def send_weights(self, version: int) -> float:
        return float((await self._call_all("send_weights", [[version]] * self.world_size))[0])

    def _micro_batches(self, batch: TrainBatch, shards: list[slice]) -> int:
        """The most micro-batches any rank runs (FSDP2 ranks all run that many)."""
        cfg = self.config
        return max(len(micro_plan(batch.rows(s), cfg.micro_batch_size, cfg.micro_batch_tokens)) for s in shards)

    async def save(self, folder: str | os.PathLike[str]) -> None:
        """Write the model (Hugging Face folder, safetensors), optimiser, scheduler and every
        rank's RNG state into ``folder`` (which must be visible to every rank)."""
        Path(folder).mkdir(parents=True, exist_ok=True)
        await self._call_all("save", [[str(folder)]] * self.world_size)

    async def load(self, folder: str | os.PathLike[str]) -> int:
        """Restore what ``save`` wrote; returns the trainer's step count."""
        steps = await self._call_all("load_checkpoint", [[str(folder)]] * self.world_size)
        return int(steps[0])

    # -- plumbing -------------------------------------------------------------------------
    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _send(self, rank: int, call: Call) -> None:
        self._sock.send_multipart([f"rank{rank}".encode(), *self._codec.encode(call)], copy=False)

    async def _call_all(self, method: str, per_rank: list[list[Any]], *, deadline: float | None = None, setting: str = "trainer.call_timeout_s") -> list[Any]:
        return await self._call_ranks(dict(enumerate(per_rank)), method, deadline=deadline, setting=setting)

    async def _call_ranks(self, per_rank: dict[int, list[Any]], method: str, *, deadline: float | None = None, setting: str = "trainer.call_timeout_s") -> list[Any]:
        if self._closed or not self._procs:
            raise RuntimeError("the trainer actor is not running: call start() first" if not self._closed else "the trainer actor is closed")
        if self._broken:
            raise RankLostError(f"the trainer is unusable ({self._broken}): restart it from a checkpoint")
        loop = asyncio.get_running_loop()
        futures = []
        for rank, args in per_rank.items():
            call = Call(id=self._new_id(), actor="trainer", method=method, args=args)
            future: asyncio.Future[Any] = loop.create_future()
            self._pending[(rank, call.id)] = (method, future)
            futures.append(future)
            self._send(rank, call)
        try:
            return await self._wait(futures, deadline or time.monotonic() + self.config.call_timeout_s, method, setting)
        finally:
            for key in [k for k, (_, f) in self._pending.items() if f in futures]:
                del self._pending[key]

    async def _wait(self, futures: list[asyncio.Future[Any]], deadline: float, what: str, setting: str) -> list[Any]:
        """The futures' results, unless a rank exits, a rank fails while its peers stay in a
        collective, or the deadline passes first."""
        first_error_at: float | None = None
        while True:
            errors = [f.exception() for f in futures if f.done() and f.exception() is not None]
            dead = [(rank, proc.returncode) for rank, proc in enumerate(self._procs) if proc.poll() is not None]
            if dead:
                rank, code = dead[0]
                self._broken = f"trainer rank {rank} exited with code {code} during {what}"
                raise RankLostError(self._broken + self._log_tail(rank)) from (errors[0] if errors else None)
            pending = [f for f in futures if not f.done()]
            if not pending:
                if errors:
                    raise errors[0]  # type: ignore[misc]
                return [f.result() for f in futures]
            now = time.monotonic()
            if errors:
                # Some ranks failed and others did not answer: those are waiting in a collective
                # for the failed ones and never will, so the group is unusable.
                first_error_at = first_error_at or now
                if now - first_error_at > STRAGGLER_GRACE_S:
                    self._broken = f"trainer ranks failed during {what} while others waited in a collective"
                    raise RankLostError(self._broken + f": {errors[0]}") from errors[0]
            if now >= deadline:
                raise CallTimeout(f"trainer {what}: no answer from every rank within the deadline; raise {setting} if the work is just slow")
            await asyncio.wait(pending, timeout=min(0.25, deadline - now), return_when=asyncio.FIRST_COMPLETED)

    async def _receive(self) -> None:
        """Route replies to their futures; drop garbage (counted in the log), never die silently."""
        try:
            while True:
                frames = await self._sock.recv_multipart(copy=False)
                sender = bytes(frames[0].buffer).decode(errors="replace")
                try:
                    rank = int(sender.removeprefix("rank"))
                    msg = self._codec.decode(frames[1:])
                except (ValueError, DecodeError) as exc:
                    log.warning("trainer actor: dropped a malformed message from %r: %s", sender, exc)
                    continue
                if isinstance(msg, Reply) and msg.id == 0 and rank in self._hello:
                    if not self._hello[rank].done():
                        self._hello[rank].set_result(msg.value)
                    continue
                method, future = self._pending.get((rank, msg.id), ("", None))
                if future is None or future.done():
                    continue
                if isinstance(msg, Reply):
                    future.set_result(msg.value)
                elif isinstance(msg, Error):
                    future.set_exception(ActorError(f"trainer rank {rank}", method, msg.type, msg.message, msg.traceback))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # hand the failure to every waiter instead of hanging them
            log.exception("trainer actor: receiver failed")
            for future in [*(f for _, f in self._pending.values()), *self._hello.values()]:
                if not future.done():
                    future.set_exception(exc)

    def _log_tail(self, rank: int, lines: int = 15) -> str:
        path = self._log_dir / f"trainer_rank{rank}.log"
        try:
            tail = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"; last lines of {path}:\n" + "\n".join(tail) if tail else ""
