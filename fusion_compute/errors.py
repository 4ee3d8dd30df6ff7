"""One base for every error a user can act on. The `fusion` command prints such an error as one line
and exits with its `exit_code` (2: the command line was wrong; 1: the run failed); anything else is
a bug, and still gets one line (FUSION_DEBUG=1 shows the traceback)."""

from __future__ import annotations


class FusionError(Exception):
    """A failure with a message meant for the user: the run could not go on."""

    exit_code = 1


class UsageError(FusionError):
    """The command line (or a file it names) asks for something that cannot work."""

    exit_code = 2


class InputError(FusionError, ValueError):
    """A request the model cannot run: empty prompt, too long, bad ids."""


class WorkerMisbehaved(FusionError):
    """A worker answered, but wrongly (a product that fails the client's check): `pids` names the
    participants found at fault. The request fails; the engine removes them from the job."""

    def __init__(self, message: str, pids: list[int], reason: str = "returned a wrong product (caught by the check)"):
        super().__init__(message)
        self.pids = pids
        self.reason = reason  # what the recovery record says of them


class WorkersSuspected(FusionError):
    """A check of the client's failed, and the evidence cannot say which of `pids` caused it (every
    worker contributed to what failed, and a liar among them could have made an honest one's output
    fail): nobody is convicted on it. The engine sets the suspects aside for standbys, and removes
    one that ambiguity has followed before (runtime/membership.py, blame.follows)."""

    def __init__(self, message: str, pids: list[int]):
        super().__init__(message)
        self.pids = pids
