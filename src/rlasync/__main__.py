"""The ``rlasync`` command (``python -m rlasync``, or the ``rlasync`` script)."""

import os
import sys


def main() -> None:
    # Where a spawner serves commands (the test suite's: rlasync.runtime.forked_commands), it runs
    # this one forked with torch and transformers loaded, and this process stands in for it.
    if os.environ.get("RLASYNC_FORK_COMMANDS"):
        from rlasync.runtime.forked_commands import run_command

        code = run_command(sys.argv[1:], module="rlasync.__main__", entry="run")
        if code is not None:
            sys.exit(code)
    run()


def run() -> None:
    """Run the command in ``sys.argv`` here, and end the process."""
    # `rlasync train` decides what Ctrl-C does once its run can act on it (rlasync.interrupts):
    # one that comes while it loads is held from this first instant, not a traceback.
    if sys.argv[1:2] == ["train"]:
        from rlasync.interrupts import hold_early

        hold_early()
    from rlasync.runtime.allocator import is_the_command

    is_the_command()  # this process is the command: it may start itself again under its allocator
    try:
        from rlasync.cli import app
        from rlasync.cli.common import bare_resume

        sys.argv[1:] = bare_resume(sys.argv[1:])
        app()
    except SystemExit as done:  # every command ends here (typer exits), error or not
        from rlasync.runtime.process import exit_process

        exit_process(done.code)
    except KeyboardInterrupt:  # another command, interrupted while it loaded
        sys.stderr.write("rlasync: interrupted\n")
        sys.exit(130)


if __name__ == "__main__":
    main()
