"""Parameters packed into fixed-size byte buckets, the unit a weight sync moves.

The plan (names, shapes, dtypes, where each tensor sits in which bucket) is computed once
from the parameters' metadata and shared by the sender and every receiver, so afterwards only
raw buckets travel. A tensor larger than the bucket size gets a bucket of its own; tensors
are never split, so a receiver can hand each bucket's tensors to its engine as they arrive.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping

import msgspec
import torch

ALIGN = 16  # bytes: each tensor starts aligned, so its view in the bucket is a valid tensor of its dtype


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch.", e.g. "float32", "bfloat16"
    offset: int = 0  # bytes into its bucket
    bucket: int = 0

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * _dtype(self.dtype).itemsize


class BucketPlan(msgspec.Struct, frozen=True):
    """Where every tensor goes: ``tensors`` in order, ``sizes`` the bytes of each bucket."""

    tensors: list[TensorSpec]
    sizes: list[int]
    lora_scale: float = 0.0
    """Non-zero: the tensors are LoRA adapters (``<layer>.lora_A.weight``, ``<layer>.lora_B.weight``)
    that each engine adds, times this scale, to its base ``<layer>.weight``
    (``rlasync.weights.adapters``); 0: they are the weights themselves."""

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    @property
    def digest(self) -> int:
        """A 63-bit fingerprint both sides compare before a sync (same plan, same layout)."""
        raw = hashlib.blake2b(msgspec.msgpack.encode(self), digest_size=8).digest()
        return int.from_bytes(raw, "little") >> 1

    def bucket(self, index: int) -> list[TensorSpec]:
        return [t for t in self.tensors if t.bucket == index]


def plan_buckets(
    named: Iterable[tuple[str, tuple[int, ...], str]],
    bucket_bytes: int,
    *,
    alone_bytes: int | None = None,
    lora_scale: float = 0.0,
) -> BucketPlan:
    """Pack ``(name, shape, dtype)`` in order into buckets of at most ``bucket_bytes``. A tensor
    of at least ``alone_bytes`` (default: ``bucket_bytes``) travels alone: its bucket is the
    tensor itself, sent without a copy. Packing costs a copy but saves collectives: on 2 CPU
    cores over gloo, 16 packed 64 MB buckets beat 177 mostly zero-copy ones (1 GB model,
    ``benchmarks/sync_bench.py``: 0.80x against 0.75x of a raw broadcast)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket size must be at least one byte, got {bucket_bytes}")
    alone_at = alone_bytes if alone_bytes is not None else bucket_bytes
    tensors: list[TensorSpec] = []
    sizes: list[int] = []  # bytes used in each bucket; the last one is open
    for name, shape, dtype in named:
        spec = TensorSpec(name, tuple(int(s) for s in shape), dtype)
        start = -(-sizes[-1] // ALIGN) * ALIGN if sizes else 0
        alone = spec.nbytes >= alone_at
        if not sizes or (
            sizes[-1] > 0
            and (alone or start + spec.nbytes > bucket_bytes or _is_alone(tensors, len(sizes) - 1, alone_at))
        ):
            sizes.append(0)
            start = 0
        tensors.append(msgspec.structs.replace(spec, offset=start, bucket=len(sizes) - 1))
        sizes[-1] = start + spec.nbytes
    return BucketPlan(tensors=tensors, sizes=sizes, lora_scale=lora_scale)


def _is_alone(tensors: list[TensorSpec], bucket: int, alone_at: int) -> bool:
    return bool(tensors) and tensors[-1].bucket == bucket and tensors[-1].nbytes >= alone_at


def solo(plan: BucketPlan, index: int) -> TensorSpec | None:
    """The tensor that is bucket ``index`` by itself, if it is one."""
    specs = plan.bucket(index)
    return specs[0] if len(specs) == 1 and specs[0].offset == 0 else None


def plan_for(
    tensors: Mapping[str, torch.Tensor], bucket_bytes: int, *, alone_bytes: int | None = None
) -> BucketPlan:
    return plan_buckets(
        ((name, tuple(t.shape), _name(t.dtype)) for name, t in tensors.items()),
        bucket_bytes,
        alone_bytes=alone_bytes,
    )


def bucket_starts(plan: BucketPlan, align: int = 64) -> list[int]:
    """Where each bucket starts in one flat buffer holding them all (``align``-byte aligned)."""
    starts, offset = [], 0
    for size in plan.sizes:
        starts.append(offset)
        offset += -(-size // align) * align
    return starts + [offset]  # the last entry: the flat buffer's size


def flat_layout(
    plan: BucketPlan, tensors: Mapping[str, torch.Tensor], *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Move ``tensors`` (parameters) into one flat buffer laid out as the plan's buckets (``out``,
    e.g. shared memory, or a new one), each tensor's data becoming a view into it, and return
    the buffer. Every bucket is then a slice of it, sent without packing. Values, shapes and
    dtypes are unchanged (an optimiser keeps working on the same Parameter objects)."""
    starts = bucket_starts(plan)
    first = next(iter(tensors.values()))
    flat = out if out is not None else torch.empty(starts[-1], dtype=torch.uint8, device=first.device)
    if flat.numel() < starts[-1] or flat.dtype != torch.uint8:
        raise ValueError(
            f"flat_layout needs a uint8 buffer of {starts[-1]} bytes, got {flat.dtype} of {flat.numel()}"
        )
    for spec in plan.tensors:
        tensor = tensors[spec.name]
        begin = starts[spec.bucket] + spec.offset
        view = flat[begin : begin + spec.nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor.detach())
        tensor.data = view
    return flat


def fill_flat(plan: BucketPlan, tensors: Mapping[str, torch.Tensor], flat: torch.Tensor) -> None:
    """Make ``flat`` (laid out as ``bucket_starts``) hold ``tensors``: buckets whose tensors
    already live there (``flat_layout``) are skipped, the others packed into place."""
    starts = bucket_starts(plan)
    for index, size in enumerate(plan.sizes):
        target = flat[starts[index] : starts[index] + size]
        there = contiguous_bucket(plan, index, tensors)
        if there is None or there.data_ptr() != target.data_ptr():
            pack(plan, index, tensors, out=target)


def contiguous_bucket(
    plan: BucketPlan, index: int, tensors: Mapping[str, torch.Tensor]
) -> torch.Tensor | None:
    """Bucket ``index`` as a uint8 view of memory the tensors already occupy in that layout
    (``flat_layout``, or a tensor that is a bucket by itself), or None if they do not."""
    specs = plan.bucket(index)
    if not specs:
        return None
    first = tensors[specs[0].name].detach()
    if not first.is_contiguous():
        return None
    storage = first.untyped_storage()
    base = first.storage_offset() * first.element_size() - specs[0].offset
    if base < 0:
        return None
    for spec in specs:
        tensor = tensors[spec.name].detach()
        if (
            tensor.untyped_storage().data_ptr() != storage.data_ptr()
            or not tensor.is_contiguous()
            or _name(tensor.dtype) != spec.dtype
            or tensor.storage_offset() * tensor.element_size() != base + spec.offset
            or tuple(tensor.shape) != spec.shape
        ):
            return None
    if base + plan.sizes[index] > storage.nbytes():
        return None
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(
        storage, base, (plan.sizes[index],), (1,)
    )


def pack(
    plan: BucketPlan, index: int, tensors: Mapping[str, torch.Tensor], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Bucket ``index`` as a flat uint8 tensor (written into ``out`` when given, to reuse it)."""
    size = plan.sizes[index]
    buffer = out[:size] if out is not None else torch.empty(size, dtype=torch.uint8)
    for spec in plan.bucket(index):
        source = tensors[spec.name].detach()
        if source.dtype != _dtype(spec.dtype) or tuple(source.shape) != spec.shape:
            raise ValueError(
                f"{spec.name}: planned {spec.dtype}{list(spec.shape)}, got {_name(source.dtype)}{list(source.shape)}"
            )
        view = buffer[spec.offset : spec.offset + spec.nbytes].view(source.dtype).view(spec.shape)
        view.copy_(source)
    return buffer


def unpack(plan: BucketPlan, index: int, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of bucket ``index``, as views into ``buffer`` (copy them to keep them)."""
    for spec in plan.bucket(index):
        yield (
            spec.name,
            buffer[spec.offset : spec.offset + spec.nbytes].view(_dtype(spec.dtype)).view(spec.shape),
        )


def flat_views(plan: BucketPlan, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """The named tensors of a flat buffer laid out as ``bucket_starts`` says, as views (no copy)."""
    starts = bucket_starts(plan)
    views: dict[str, torch.Tensor] = {}
    for index, size in enumerate(plan.sizes):
        views.update(unpack(plan, index, flat[starts[index] : starts[index] + size]))
    return views


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype
