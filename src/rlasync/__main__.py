"""The ``rlasync`` command (``python -m rlasync``, or the ``rlasync`` script)."""

import sys


def main() -> None:
    # `rlasync train` decides what Ctrl-C does once its run can act on it (rlasync.interrupts):
    # one that comes while it loads is held from this first instant, not a traceback.
    if sys.argv[1:2] == ["train"]:
        from rlasync.interrupts import hold_early

        hold_early()
    try:
        from rlasync.cli import app

        app()
    except SystemExit as done:  # every command ends here (typer exits), error or not
        from rlasync.runtime.process import exit_process

        exit_process(done.code)
    except KeyboardInterrupt:  # another command, interrupted while it loaded
        sys.stderr.write("rlasync: interrupted\n")
        sys.exit(130)


if __name__ == "__main__":
    main()
