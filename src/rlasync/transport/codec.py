"""Encode wire messages to ZeroMQ frames and back, with tensors and large bytes out of band.

A message is ``[body, *side_frames]``; the body's first byte names the message's Struct
(one decoder per Struct), the rest is msgpack. The kind shares the body's frame because
every frame costs a ZeroMQ operation on each side (measured: fewer frames, more calls/s).

Values inside a message may be anything msgspec encodes, plus ``torch.Tensor`` (any dtype,
bf16 included; any layout: non-contiguous tensors are made contiguous; 0-d and empty
tensors too) and ``bytes``. A tensor or a top-level ``bytes`` argument of at least
``zero_copy_threshold`` bytes becomes its own frame, sent without copying; the body holds
only its dtype, shape and frame index. Smaller ones ride inside the body.

A tensor is copied once when encoded (the message never aliases the caller's memory);
``bytes`` are immutable and travel as they are.

No pickle: a frame that does not decode to the exact Struct of its kind raises
``DecodeError`` and is dropped by the caller of ``decode``.

The codec keeps per-message state while encoding or decoding, so each event loop uses its
own instance (the runtime has one per node).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from .messages import KIND_OF, TYPE_OF, Message

EXT_TENSOR = 1
EXT_BYTES = 2
EXT_USER = 16  # first code free for ``Codec.register`` (the runtime sends actor refs this way)


class DecodeError(ValueError):
    """A frame list is not a valid message; it is dropped and counted, never fatal."""


class OversizedBody(DecodeError):
    """A body past the codec's ``max_body_bytes``: refused before decoding (decoding holds the loop)."""


class NeedsTorch(Exception):
    """The message holds a tensor and torch is not imported yet. Importing it takes seconds:
    the receiver does that off the event loop (``asyncio.to_thread``), then decodes again."""


MAX_TENSOR_DIMS = 32


class TensorMeta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    dtype: str
    shape: list[int]
    frame: int = -1  # index among the side frames, or -1 when ``data`` holds the bytes inline
    data: bytes = b""


def _torch() -> Any:
    # Imported on first use so the control plane (and `rlasync --help`) never pays for torch.
    import torch

    return torch


class Codec:
    """Turns messages into ``[kind, body, *side]`` frames and back."""

    def __init__(self, zero_copy_threshold: int = 65536, max_body_bytes: int = 2**62) -> None:
        self.threshold = zero_copy_threshold
        self.max_body_bytes = max_body_bytes
        self._side: list[Any] = []
        self._rx_side: Sequence[Any] = ()
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._meta_encoder = msgspec.msgpack.Encoder()
        self._meta_decoder = msgspec.msgpack.Decoder(TensorMeta)
        self._user_types: dict[type, tuple[int, Callable[[Any], Any]]] = {}
        self._user_codes: dict[int, Callable[[Any], Any]] = {}
        # One decoder per kind byte; each decodes its own Struct type of the Message union.
        self._decoders: dict[bytes, msgspec.msgpack.Decoder[Any]] = {
            kind: msgspec.msgpack.Decoder(cls, ext_hook=self._ext_hook) for kind, cls in TYPE_OF.items()
        }

    def register(
        self, cls: type, code: int, to_wire: Callable[[Any], Any], from_wire: Callable[[Any], Any]
    ) -> None:
        """Send instances of ``cls`` as ``to_wire(obj)`` (plain data), rebuilt by ``from_wire``."""
        if code < EXT_USER or code > 127:
            raise ValueError(f"extension code must be in [{EXT_USER}, 127], got {code}")
        self._user_types[cls] = (code, to_wire)
        self._user_codes[code] = from_wire

    # -- encoding -------------------------------------------------------------------------
    def encode(self, msg: Message) -> list[Any]:
        """Frames for ``msg``: the body (kind byte, then msgpack), then any side frames."""
        side: list[Any] = []
        self._side = side
        body = bytearray(KIND_OF[type(msg)])
        try:
            self._encoder.encode_into(msg, body, 1)
        finally:
            self._side = []
        return [body, *side] if side else [body]

    def lift(self, values: list[Any]) -> list[Any]:
        """Mark large top-level ``bytes`` in ``values`` to travel as side frames."""
        threshold = self.threshold
        for i, value in enumerate(values):
            if type(value) is bytes and len(value) >= threshold:
                values[i] = _LiftedBytes(value)
        return values

    def lift_one(self, value: Any) -> Any:
        """``value``, marked to travel as a side frame if it is large ``bytes``."""
        if type(value) is bytes and len(value) >= self.threshold:
            return _LiftedBytes(value)
        return value

    def _enc_hook(self, obj: Any) -> Any:
        if type(obj) is _LiftedBytes:
            self._side.append(obj.data)
            return msgspec.msgpack.Ext(EXT_BYTES, self._meta_encoder.encode(len(self._side) - 1))
        user = self._user_types.get(type(obj))
        if user is not None:
            return msgspec.msgpack.Ext(user[0], self._meta_encoder.encode(user[1](obj)))
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return msgspec.msgpack.Ext(EXT_TENSOR, self._meta_encoder.encode(self._tensor_meta(obj)))
        raise TypeError(
            f"cannot send a {type(obj).__module__}.{type(obj).__qualname__} between actors: use "
            "msgspec-encodable values (Structs, dataclasses, dicts, lists, scalars), bytes or torch tensors"
        )

    def _tensor_meta(self, tensor: Any) -> TensorMeta:
        torch = _torch()
        if tensor.layout != torch.strided:
            raise TypeError(f"cannot send a {tensor.layout} tensor: convert it with .to_dense() first")
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()  # tensors cross processes via host memory; weights use torch.distributed
        t = t.resolve_conj().resolve_neg().contiguous()
        if t.data_ptr() == tensor.data_ptr() and t.numel():
            # The frame may leave later (batched, queued behind a full peer): own a copy, so the
            # caller can change its tensor right after the call without changing the message.
            t = t.clone()
        dtype = str(t.dtype).removeprefix("torch.")
        shape = list(t.shape)
        # Viewing as bytes works for every dtype (bf16 has no numpy type) and every shape.
        raw = t.reshape(-1).view(torch.uint8).numpy()
        if raw.nbytes >= self.threshold:
            self._side.append(raw)
            return TensorMeta(dtype, shape, frame=len(self._side) - 1)
        return TensorMeta(dtype, shape, data=raw.tobytes())

    # -- decoding -------------------------------------------------------------------------
    def decode(self, frames: Sequence[Any]) -> Message:
        """The message in ``[body, *side]``; raises DecodeError if it is not one."""
        if not frames:
            raise DecodeError("expected at least one frame (the body), got none")
        body = memoryview(_as_buffer(frames[0]))
        if body.nbytes > self.max_body_bytes:
            raise OversizedBody(
                f"a body of {body.nbytes} bytes is past runtime.max_body_bytes={self.max_body_bytes}"
            )
        kind = bytes(body[:1])
        decoder = self._decoders.get(kind)
        if decoder is None:
            raise DecodeError(f"unknown message kind {kind!r}")
        self._rx_side = frames[1:]
        try:
            return decoder.decode(body[1:])
        except NeedsTorch:
            raise
        except Exception as exc:  # garbage may fail in any way; none of it may escape
            raise DecodeError(f"malformed {TYPE_OF[kind].__name__}: {exc}") from None
        finally:
            self._rx_side = ()

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == EXT_BYTES:
            index = msgspec.msgpack.decode(data, type=int)
            return _as_bytes(self._rx_side[index])
        if code == EXT_TENSOR:
            return self._decode_tensor(self._meta_decoder.decode(data))
        from_wire = self._user_codes.get(code)
        if from_wire is not None:
            return from_wire(msgspec.msgpack.decode(data))
        raise DecodeError(f"unknown extension type {code}")

    def _decode_tensor(self, meta: TensorMeta) -> Any:
        torch = sys.modules.get("torch")
        if torch is None:
            raise NeedsTorch()
        if len(meta.shape) > MAX_TENSOR_DIMS:
            raise DecodeError(f"a tensor of {len(meta.shape)} dimensions (at most {MAX_TENSOR_DIMS})")
        dtype = getattr(torch, meta.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise DecodeError(f"unknown tensor dtype {meta.dtype!r}")
        if meta.frame >= 0:
            buffer: Any = _as_buffer(self._rx_side[meta.frame])
        else:
            buffer = bytearray(meta.data)  # copy: the body's memory is not ours to keep
        numel = 1
        for size in meta.shape:
            if size < 0:
                raise DecodeError(f"negative tensor size in shape {meta.shape}")
            numel *= size
            if numel > 2**48:  # the byte count below cannot match: stop before the product grows
                raise DecodeError(f"tensor shape {meta.shape} is too large")
        itemsize = dtype.itemsize
        if numel * itemsize != len(buffer):
            raise DecodeError(
                f"tensor of shape {meta.shape} and dtype {meta.dtype} needs {numel * itemsize} bytes, frame has {len(buffer)}"
            )
        if len(buffer) == 0:
            return torch.empty(meta.shape, dtype=dtype)
        with warnings.catch_warnings():
            # The frame's memory belongs to this message alone once received, so sharing it
            # with the tensor (zero-copy) is safe even though the buffer is marked read-only.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(buffer, dtype=torch.uint8)
        return flat.view(dtype).reshape(meta.shape)


class _LiftedBytes:
    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def _as_bytes(frame: Any) -> bytes:
    if type(frame) is bytes:
        return frame
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)


def _as_buffer(frame: Any) -> Any:
    return frame.buffer if hasattr(frame, "buffer") else frame
