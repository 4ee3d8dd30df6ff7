"""What `fusion worker`, `serve` and `generate` (and chat) write on stderr while they run: the standard
`logging` module, configured here once per process, for the package's logger (`fusion_compute`).

Library modules log with `logging.getLogger(__name__)` and never configure anything; without this
set-up (a library user's program) their warnings reach Python's last-resort handler and the info
lines stay silent.

Two formats (`--log-format`):
- text: `fusion worker: joined epoch 0 as rank 1 of 2`, and off a terminal (nohup, systemd, CI, a
  pipe) with a UTC timestamp in front, `2026-12-04T18:22:14.123Z fusion worker: ...`; warnings say
  `warning:` after the program's name.
- json: one object per line, `{"time", "level", "prog", "pid", "message"}`, for log collectors; the
  command's final error line is then such an object too.

`--quiet` keeps warnings and errors only. The command's one-line error (cli/main.py) stays plain
text in the text format (what scripts and a spawning client read), whatever the stream.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO

from ..runtime.progress import is_tty

PACKAGE = "fusion_compute"


def _utc(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class TextFormatter(logging.Formatter):
    def __init__(self, prog: str, timestamps: bool):
        super().__init__()
        self.prog, self.timestamps = prog, timestamps

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        line = f"{self.prog}: {level}{record.getMessage()}"
        return f"{_utc(record)} {line}" if self.timestamps else line


class JsonFormatter(logging.Formatter):
    def __init__(self, prog: str):
        super().__init__()
        self.prog = prog

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(
            {
                "time": _utc(record),
                "level": record.levelname.lower(),
                "prog": self.prog,
                "pid": record.process,
                "message": record.getMessage(),
            },
            ensure_ascii=False,
        )


class StderrHandler(logging.StreamHandler):
    """Writes each record to sys.stderr as it is then (a redirection made later, a test's capture), not
    to the stream it was when the handler was made."""

    @property
    def stream(self) -> IO[str]:
        return sys.stderr

    @stream.setter
    def stream(self, _value: IO[str]) -> None:
        pass


def setup(prog: str, *, quiet: bool = False, fmt: str = "text", info: bool = True, stream: IO[str] | None = None):
    """Send the package's log records to `stream` (stderr) as `prog`'s lines. `info`: show the info
    lines (False: warnings and errors only, as `quiet`); returns the logger for the command's own lines."""
    handler: logging.StreamHandler = logging.StreamHandler(stream) if stream is not None else StderrHandler()
    stream = stream or sys.stderr  # flushes after every record
    handler.setFormatter(JsonFormatter(prog) if fmt == "json" else TextFormatter(prog, timestamps=not is_tty(stream)))
    root = logging.getLogger(PACKAGE)
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if info and not quiet else logging.WARNING)
    root.propagate = False
    return logging.getLogger(f"{PACKAGE}.cli")


def error_line(prog: str, message: str, stream: IO[str] | None = None) -> None:
    """The command's final error: a JSON record when the log format is json, else one plain line."""
    root = logging.getLogger(PACKAGE)
    if any(isinstance(h.formatter, JsonFormatter) for h in root.handlers):
        logging.getLogger(f"{PACKAGE}.cli").error(message)
        return
    print(f"{prog}: error: {message}", file=stream or sys.stderr)


def engine_notice(logger: logging.Logger):
    """An `EngineOptions.log` that logs the engine's notices (refused connections, recoveries, the
    --insecure warning): "warning: ..." and every recovery as warnings, "note: ..." as info."""

    def log(line: str) -> None:
        if line.startswith("note: "):
            logger.info(line.removeprefix("note: "))
        else:
            logger.warning(line.removeprefix("warning: "))

    return log
