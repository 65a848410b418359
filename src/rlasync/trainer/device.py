"""Where a trainer rank computes: ``trainer.device`` resolved on the rank's machine.

    device = pick_device("auto", index=1, needed=3)   # cuda:1 on a 3-GPU machine, else the CPU

``needed`` is the same for every rank of a trainer (``RankSpec.devices_needed``), so with
``auto`` they all choose GPUs or all the CPU.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def pick_device(setting: str, index: int, needed: int = 0) -> torch.device:
    """``auto``: GPU ``index`` of this machine when it has ``needed`` GPUs (at least ``index + 1``),
    else the CPU; ``cuda``: GPU ``index``, wrapped onto the machine's GPUs when it has fewer."""
    count = torch.cuda.device_count()
    if setting == "auto" and count < max(needed, index + 1):
        if count:
            log.warning(
                "trainer.device=auto: the ranks need GPUs up to index %d (after the engines' on the same "
                "machine) and this machine has %d, so the trainer runs on the CPU. Share the engines' GPU "
                "with cluster.colocate=true, place ranks on other machines (cluster.trainer), or set "
                "trainer.device=cuda to put ranks on GPUs the engines use.",
                max(needed, index + 1) - 1,
                count,
            )
        return torch.device("cpu")
    if setting == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but torch sees no GPU: use trainer.device=cpu (or auto)")
    return torch.device("cuda", index % count)
