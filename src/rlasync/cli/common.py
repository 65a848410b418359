"""What several commands share: the config they hand on, with the ``--plugin`` ones in it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import Config


def with_plugins(cfg: Config, extra: list[str]) -> Config:
    """``cfg`` with the ``--plugin`` ones added to its ``plugins``, file paths made absolute: the
    processes it reaches (nodes, launched hosts) may run elsewhere."""
    import msgspec

    from ..plugins import resolved

    return msgspec.structs.replace(cfg, plugins=list(resolved([*cfg.plugins, *extra])))
