"""The ``rlasync`` command line: the Typer ``app``, one module per command (``rlasync --help``
lists them in the order registered here). Heavy imports happen inside commands, so ``--help``
is instant; a command's failures map to exit codes through ``errors``."""

from __future__ import annotations

import typer

from . import eval, export, launch, node, plan, serve, status, train

app = typer.Typer(
    help="rlasync: asynchronous RL post-training without Ray.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",  # help text is Markdown: `code`, paragraphs rewrapped
)

for command in (
    node.node,
    train.train,
    launch.launch,
    status.status,
    serve.serve,
    plan.plan,
    status.secret,
    status.version,
    status.show,
    status.plot,
):
    app.command()(command)
app.command("eval")(
    eval.evaluate
)  # after plan in `--help`; `eval` is Python's builtin, so not the function's name
app.command()(export.export)

__all__ = ["app"]
