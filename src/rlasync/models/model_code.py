"""Importing this module loads transformers' model code: ``transformers.modeling_utils`` and
what it pulls in (``torch.distributed.tensor`` among them), about 2 s of CPU with the GIL held.
Every model class builds on it, so afterwards a model's own module (Qwen2, Llama) loads in tens
of milliseconds. A training run's nodes preload it (``rlasync.config.cluster.NODE_MODULES``): it
loads before a node joins, not when the node's first engine or trainer rank loads a model while
the node's heartbeats wait.
"""

from __future__ import annotations

from .tiny import keep_temporary_folder_clean

keep_temporary_folder_clean()  # before torch._dynamo, which transformers' model code imports

import transformers.modeling_utils  # noqa: E402, F401  # the import is the point
