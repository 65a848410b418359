"""Wire messages, the codec (msgpack + out-of-band tensor frames) and ZeroMQ I/O."""

from .codec import Codec, DecodeError
from .messages import Call, Cancel, Error, Reply, StreamAck, StreamEnd, StreamItem

__all__ = ["Call", "Cancel", "Codec", "DecodeError", "Error", "Reply", "StreamAck", "StreamEnd", "StreamItem"]
