"""What ``rlasync train`` shows while it runs: in a terminal a live display (rich) of the phase
(the warm-start, then RL), steps done, reward, throughput, held-out accuracy and the time left,
with log lines printed above it; elsewhere (a log file, CI) plain lines every ten steps and at
each validation.

    with RunProgress(steps=600) as progress:
        warm_start(..., on_check=progress.warmstart)   # the warm-start's checks
        await train(config, on_step=progress.step)     # each line of metrics.jsonl
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class RunProgress:
    """A run's progress; ``live``: the rich display (default: when ``out`` is a terminal)."""

    def __init__(self, steps: int, *, live: bool | None = None, out: TextIO | None = None) -> None:
        self.steps = steps
        self.out = out or sys.stdout
        self.live = self.out.isatty() if live is None else live
        self._since: float | None = None  # when this process's first RL step began
        self._first = 0  # the step before it (a resumed run starts later)
        self._info = ""
        self.console = Console(file=self.out)
        self._progress: Progress | None = None
        self._warm: Any = None  # the warm-start's task on the display
        self._rl: Any = None

    def __enter__(self) -> RunProgress:
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(bar_width=20),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
                console=self.console,
                transient=False,
            )
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def log_handler(self) -> logging.Handler:
        """Where log lines go so that they print above the live display (plain: stderr)."""
        if self.live:
            return RichHandler(console=self.console, show_path=False, markup=False)
        handler = logging.StreamHandler(sys.stderr)
        # The level, as the node processes print it: a WARNING in a log file is seen as one.
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        return handler

    def warmstart(self, step: int, max_steps: int, sampled: float, greedy: float) -> None:
        """One check of the warm-start (called from its thread: rich's display is thread-safe)."""
        if self._progress is None:
            return  # plain output: the warm-start logs its checks itself
        info = f"accuracy sampled {sampled:.3f} greedy {greedy:.3f}"
        if self._warm is None:
            self._warm = self._progress.add_task("warm-start", total=max_steps, info=info)
        self._progress.update(self._warm, completed=step, info=info)

    def step(self, record: dict[str, Any]) -> None:
        """A line of ``metrics.jsonl`` as it is written."""
        step, now = int(record["step"]), time.perf_counter()
        if step == 0:  # the starting weights' validation
            self._info = f"val {record['val_accuracy']:.3f}" if "val_accuracy" in record else ""
            return
        took = float(record.get("rollout_s", 0.0)) + float(record.get("train_s", 0.0))
        if self._since is None:
            self._since, self._first = now - took, step - 1
        tokens = float(record.get("response_tokens", 0)) / took if took > 0 else 0.0
        val = f"  val accuracy {record['val_accuracy']:.3f}" if "val_accuracy" in record else ""
        if self._progress is not None:
            if self._warm is not None:
                self._progress.update(self._warm, visible=False)
            if self._rl is None:
                self._rl = self._progress.add_task("RL", total=self.steps, info="")
            if val:
                self._info = val.strip()
            info = f"reward {float(record.get('reward') or 0.0):.3f}  {tokens:6.0f} tokens/s  {self._info}"
            self._progress.update(self._rl, completed=step, info=info)
            return
        if step % 10 and not val:
            return
        eta = (now - self._since) / max(step - self._first, 1) * (self.steps - step)
        print(
            f"step {step:4d}/{self.steps}  reward {float(record.get('reward') or 0.0):.3f}  {tokens:7.0f} tokens/s  ETA {eta:4.0f} s{val}",
            file=self.out,
            flush=True,
        )


__all__ = ["RunProgress"]
