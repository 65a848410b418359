"""What several commands share: the config they hand on, with the ``--plugin`` ones in it; the
``--resume[=auto]`` option of the commands that start a run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from ..config import Config


def with_plugins(cfg: Config, extra: list[str]) -> Config:
    """``cfg`` with the ``--plugin`` ones added to its ``plugins``, file paths made absolute: the
    processes it reaches (nodes, launched hosts) may run elsewhere."""
    import msgspec

    from ..plugins import resolved

    return msgspec.structs.replace(cfg, plugins=list(resolved([*cfg.plugins, *extra])))


RESUME_HELP = (
    "`--resume`: continue from the newest checkpoint in train.run_dir. `--resume=auto`: the same "
    "when there is one, else start afresh (the one command a requeued or restarted job runs again)."
)
NEWEST = "newest"  # what a bare --resume means (``bare_resume`` spells it out)


def bare_resume(argv: list[str]) -> list[str]:
    """``argv`` with a bare ``--resume`` spelled ``--resume=newest``: the option takes a value
    (``--resume=auto``), which Typer cannot leave optional."""
    return [f"--resume={NEWEST}" if arg == "--resume" else arg for arg in argv]


def parse_resume(value: str, who: str) -> bool | Literal["auto"]:
    """``--resume``'s value: False (not given), True (bare, or ``newest``) or ``"auto"``."""
    import typer

    if value in ("", NEWEST, "auto"):
        return "auto" if value == "auto" else value == NEWEST
    raise typer.BadParameter(
        f"{who}: --resume takes no value, or =auto (not {value!r})", param_hint="--resume"
    )
