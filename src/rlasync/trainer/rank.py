"""One trainer rank: a process that holds a ``PolicyTrainer`` and answers its controller.

Started by ``TrainerActor`` (``python -m rlasync.trainer.rank …``), never by hand. It joins the
trainer's torch.distributed group, says hello over a ZeroMQ DEALER socket, then serves calls
one at a time (they are collective: every rank runs the same call in the same order) until
``shutdown``, until its controller process is gone (it checks every second, so a crashed
controller leaves no orphans), or until a collective fails (a peer rank died).

Messages are the runtime's ``Call``/``Reply``/``Error`` (``transport.messages``) through its
codec: tensors travel as side frames, never pickled.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import logging
import os
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import zmq

from ..config import convert
from ..config.train import TrainerConfig
from ..transport.codec import Codec, DecodeError
from ..transport.messages import Call, Error, Reply
from .policy import PolicyTrainer
from .types import TrainBatch

log = logging.getLogger(__name__)


class RankServer:
    """The endpoints of one rank. Each returns plain data or tensors."""

    def __init__(self, rank: int, world_size: int, device: torch.device) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.trainer: PolicyTrainer | None = None
        self.sender: Any = None  # the WeightSender, on rank 0 once joined
        self.flat: Any = None  # the buffer rank 0's parameters live in once laid out as buckets
        self.shared: Any = None  # SharedWeights: the same-host fast path, when offered

    def _trainer(self) -> PolicyTrainer:
        if self.trainer is None:
            raise RuntimeError("the trainer has no model yet: call load first")
        return self.trainer

    def load(self, model_dir: str, config: dict[str, Any], total_steps: int) -> dict[str, Any]:
        from ..models import load_pretrained_dir

        cfg = convert(config, TrainerConfig)
        model, _ = load_pretrained_dir(model_dir, device=str(self.device))
        self.trainer = PolicyTrainer(model, cfg, total_steps=total_steps)
        gc.freeze()  # start-up's objects live as long as the rank: full collections never rescan them
        return {"parameters": sum(p.numel() for p in model.parameters()), "device": str(self.device)}

    def step(self, batch: dict[str, Any], temperature: float, denominator: float, micro_batches: int) -> dict[str, float]:
        rows = TrainBatch.from_tensors(batch)
        if self.shared is not None:
            self.shared.invalidate()  # the parameters in shared memory change now: no engine may copy them
        started = time.perf_counter()
        metrics = self._trainer().step(rows, temperature=temperature, denominator=denominator, micro_batches=micro_batches)
        return {**metrics, "compute_s_max": time.perf_counter() - started}  # the slowest rank's, once reduced

    def logprobs(self, batch: dict[str, Any], temperature: float, micro_batches: int, reference: bool = False) -> Any:
        trainer, rows = self._trainer(), TrainBatch.from_tensors(batch)
        return trainer.reference_logprobs(rows, temperature) if reference else trainer.compute_logprobs(rows, temperature, micro_batches=micro_batches)

    def weights(self) -> dict[str, Any] | None:
        weights = self._trainer().weights()  # every rank: gathering shards is collective
        return weights if self.rank == 0 else None

    # -- weight sync (rank 0 sends; the others take part in gathering sharded parameters) ---
    def weight_plan(self, bucket_bytes: int, alone_bytes: int) -> bytes:
        """The bucket plan of this model's parameters (names, shapes, dtypes), as msgpack."""
        from ..weights import plan_buckets

        named = [(name, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for name, p in self._trainer().model.named_parameters()]
        return msgspec.msgpack.encode(plan_buckets(named, bucket_bytes, alone_bytes=alone_bytes))

    def share_weights(self, directory: str, plan: bytes) -> list[Any] | None:
        """Rank 0 on a CPU: lay the parameters out in a shared-memory file in ``directory`` and
        return its ``ShmOffer`` (engines on this machine copy from it); else None."""
        if self.rank != 0:
            return None
        from ..weights import BucketPlan, SharedWeights, flat_layout

        trainer = self._trainer()
        if self.device.type != "cpu":
            return None  # GPU parameters: NCCL is the fast path (CUDA IPC is not written)
        if self.shared is not None:
            self.shared.close()
        self.shared = SharedWeights.create(directory, msgspec.msgpack.decode(plan, type=BucketPlan))
        if not trainer.sharded:  # the optimizer then updates the parameters in the shared file itself
            self.flat = flat_layout(self.shared.plan, dict(trainer.model.named_parameters()), out=self.shared.data)
        return list(msgspec.to_builtins(self.shared.offer))

    def weight_backend(self) -> str:
        """The weight group's backend this rank's parameters call for: NCCL on a GPU, else gloo."""
        return "nccl" if self.device.type == "cuda" else "gloo"

    def join_weights(self, host: str, port: int, size: int, timeout_s: float, generation: int, plan: bytes, backend: str = "") -> None:
        """Rank 0 hosts the weight group's store and becomes its rank 0 (a new generation after
        a failure). ``size`` 1: no engine takes the broadcast (all copy from shared memory)."""
        if self.rank != 0:
            return
        from ..weights import BucketPlan, WeightGroup, WeightSender, flat_layout

        store = None
        if self.sender is not None:
            self.sender.group.close()
            if self.sender.group.address == (host, port):  # a new generation of the same group: same store
                store = self.sender.group.store
            self.sender = None
        bucket_plan = msgspec.msgpack.decode(plan, type=BucketPlan)
        trainer = self._trainer()
        if not trainer.sharded and self.device.type == "cpu" and self.flat is None:
            # Parameters move into one buffer laid out as the buckets: each bucket is then sent
            # straight from the parameters' memory (no packing copy).
            self.flat = flat_layout(bucket_plan, dict(trainer.model.named_parameters()))
        if size > 1:
            backend = backend or self.weight_backend()
            group = WeightGroup(host, port, 0, size, backend=backend, timeout_s=timeout_s, generation=generation, store=store)
            self.sender = WeightSender(group, bucket_plan, device=self.device)

    def send_weights(self, version: int) -> float:
        """Publish the current parameters as ``version``: into shared memory (if offered) and
        over the weight group (if any engine takes the broadcast); returns rank 0's seconds."""
        weights = self._trainer().weights(copy=False)  # every rank: gathering shards is collective
        if self.rank != 0:
            return 0.0
        started = time.perf_counter()
        if self.shared is not None:
            from ..weights import fill_flat

            fill_flat(self.shared.plan, weights, self.shared.data)  # no copy when already laid out there
            self.shared.publish(version)
        if self.sender is not None:
            self.sender.send(weights, version)
        elif self.shared is None:
            raise RuntimeError("no weight group and no shared memory: call join_weights first")
        return time.perf_counter() - started

    def close_weights(self) -> None:
        """Remove the shared-memory file (engines that mapped it keep their mapping)."""
        if self.shared is not None:
            self.shared.close()

    def save(self, folder: str) -> None:
        path = Path(folder)
        self._trainer().save(path, write=self.rank == 0)  # every rank: gathering shards is collective
        torch.save(_rng_state(), path / f"rng_rank{self.rank}.pt")

    def load_checkpoint(self, folder: str) -> int:
        path = Path(folder)
        if self.shared is not None:
            self.shared.invalidate()
        self._trainer().load(path)
        rng = path / f"rng_rank{self.rank}.pt"
        if rng.is_file():
            _set_rng_state(torch.load(rng, weights_only=False))
        return self._trainer().steps

    def ping(self) -> int:
        return os.getpid()


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def pick_device(setting: str, rank: int) -> torch.device:
    """``auto``: this rank's GPU (one per rank, by local rank) when there are enough, else the CPU."""
    if setting == "cpu" or (setting == "auto" and torch.cuda.device_count() <= rank):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but torch sees no GPU: use trainer.device=cpu (or auto)")
    return torch.device("cuda", rank % torch.cuda.device_count())


def serve(args: argparse.Namespace) -> int:
    parent = os.getppid()
    if args.cpus:
        wanted = {int(c) for c in args.cpus.split(",")}
        usable = wanted & set(range(os.cpu_count() or 1))  # the machine's cores, not the ones inherited from the parent
        if usable:
            os.sched_setaffinity(0, usable)
        else:
            log.warning("trainer.cpu_affinity=%s: none of these cores is available here; running on any", sorted(wanted))
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device, args.rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=args.init_method, rank=args.rank, world_size=args.world_size,
        timeout=datetime.timedelta(seconds=args.collective_timeout_s),
    )  # fmt: skip
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, f"rank{args.rank}".encode())  # the actor addresses ranks by this
    sock.connect(args.controller)
    codec = Codec()
    server = RankServer(args.rank, args.world_size, device)
    sock.send_multipart(codec.encode(Reply(id=0, value={"rank": args.rank, "pid": os.getpid(), "backend": backend})))
    try:
        while True:
            if not sock.poll(1000):
                if os.getppid() != parent:
                    log.warning("trainer rank %d: the controller is gone, exiting", args.rank)
                    return 1
                continue
            frames = sock.recv_multipart(copy=False)
            try:
                msg = codec.decode(frames)
            except DecodeError as exc:
                log.warning("trainer rank %d: dropped a malformed message: %s", args.rank, exc)
                continue
            if not isinstance(msg, Call):
                continue
            if msg.method == "shutdown":
                server.close_weights()
                sock.send_multipart(codec.encode(Reply(id=msg.id)))
                return 0
            endpoint = getattr(server, msg.method, None) if not msg.method.startswith("_") else None
            try:
                if endpoint is None:
                    raise AttributeError(f"trainer ranks have no endpoint {msg.method!r}")
                reply: Any = Reply(id=msg.id, value=endpoint(*msg.args, **msg.kwargs))
            except Exception as exc:
                log.exception("trainer rank %d: %s failed", args.rank, msg.method)
                reply = Error(id=msg.id, code="raised", type=type(exc).__name__, message=str(exc), traceback=traceback.format_exc())
                if isinstance(exc, dist.DistBackendError):  # a peer died mid-collective: the group is broken
                    sock.send_multipart(codec.encode(reply))
                    return 3
            sock.send_multipart(codec.encode(reply))
    finally:
        server.close_weights()
        sock.close(0)
        ctx.term()
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlasync.trainer.rank", description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--controller", required=True, help="the controller's ZeroMQ address")
    parser.add_argument("--init-method", required=True, help="torch.distributed init method (file:// or tcp://)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cpus", default="", help="comma-separated CPU cores to run on (empty: any)")
    parser.add_argument("--collective-timeout-s", type=float, default=900.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("RLASYNC_LOG_LEVEL", "WARNING").upper(), format=f"%(asctime)s trainer-rank{args.rank} %(name)s %(levelname)s %(message)s")
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())

