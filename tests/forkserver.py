"""Start the suite's local workers from a fork server that has already imported torch.

A worker started by `subprocess.Popen` spends 2-3 s of CPU importing torch and the package before
it does anything; the suite starts several hundred. The local executor takes the function that
starts a worker (`EngineOptions.spawn`, executor/local.py); `fork_workers()` makes this server's
`forked_worker` every job's default in this process, so the suite's many EngineOptions need not
name it: multiprocessing's forkserver (the standard library's)
imports torch and the worker's modules once, then forks a child per worker, which runs the very
`fusion worker ARGS` entry point with the worker's environment, log and stdin (its secret key).

What differs from a Popen'd worker, and why the tests that check it keep real processes (the
`real_workers` fixture in conftest.py):
- its parent is the fork server, not the client: PR_SET_PDEATHSIG fires when the fork server
  exits, which it does once the test process and every forked command have closed its alive pipe
  (a forked worker closes its copy at once), so a worker still dies with the test run, one step
  removed;
- its command line is the fork server's, so `pgrep -f "fusion_compute worker"` misses it
  (procs.worker_pids() reads the registry below; procs.children() counts the fork server's
  children as the test process's own);
- torch was imported under the fork server's environment: a variable read only at import time
  (OMP_NUM_THREADS, OPENBLAS_NUM_THREADS) is not re-read; the workers set their thread counts
  at run time (torch.set_num_threads; masked/ring.py's limit_blas_threads for OpenBLAS), the count
  their client gives them, which $OMP_NUM_THREADS (conftest.py) caps (engine_options.default_threads).

`command()` does the same for a whole `fusion ARGS` command (procs.fusion and procs.run use it): a
forked child runs cli.main's `main(ARGS)` with the standard streams, environment and working
directory the test gives it, leaves as the interpreter would (non-daemon threads joined, atexit
handlers run, streams flushed, the exit status main returned), and starts its own local workers from
this same fork server. What differs from `python -m fusion_compute ARGS`:
- torch, the package and cryptography are already imported, so a test cannot see what a command
  imports, nor anything an import prints (test_structure.py checks that bad input is refused
  before torch loads, in a fresh interpreter; the README tests run the installed script);
- its parent is the fork server, and so is its workers': `pgrep -P` finds none of them. Whoever
  asks for a fork writes it down in the test process's registry (a file per forked pid: its role,
  the asker's pid and its start time, against reused pids), so procs.children(PID) and
  procs.worker_pids() still find them;
- its workers die with the fork server (PR_SET_PDEATHSIG), not with it; killed, it loses them as a
  client on another host does, by its links closing. The tests of a terminal (test_chat,
  test_serve_progress), of the installed `fusion` script (test_wire's README key steps; its workers
  and client are forked with the README's argv) and of processes under mpiexec (test_mpi_cluster's
  workers; its clients are forked) start real processes (procs.FUSION).

A command can also be forked into a network namespace (`command(netns=...)`, tests/netns.py's
`Hosts.fusion` and `Hosts.python`: test_wire's captures, test_faults's cut link): the child enters the
namespace with setns before it runs anything, as `ip netns exec` does first, and so do the workers it
starts; `_enter_netns` says what `ip netns exec` does besides, which no test needs.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.reduction
import multiprocessing.util
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import IO, Any

# What a worker imports before it serves, so that no forked child imports it again: the profile of
# a suite run (py-spy) showed cryptography's serialization, imported lazily by the key file's
# loader, costing ~0.25 s of CPU in each of ~300 forked workers.
PRELOAD = [
    "torch",
    "numpy",
    "cryptography.hazmat.primitives.asymmetric.ed25519",
    "cryptography.hazmat.primitives.serialization",
    "cryptography.x509",
    "fusion_compute.cli.main",
    "fusion_compute.cli.serve",
    "fusion_compute.cli.chat",
    "fusion_compute.audit.cli",
    "fusion_compute.bench.run",
    "fusion_compute.structural.worker",
    "fusion_compute.masked.member",
    "fusion_compute.masked.worker",
    "fusion_compute.weights.gguf",
]

# The folder where every fork is written down (use_registry; registered() reads it). Not the
# environment: a forked process's /proc/PID/environ shows the fork server's, whatever it sets.
_registry: str | None = None


def use_registry(folder: str) -> None:
    global _registry
    _registry = folder


def _register(pid: int, role: str) -> None:
    if _registry is not None:
        with open(os.path.join(_registry, str(pid)), "w") as f:
            f.write(f"{role} {os.getpid()} {start_time(pid)}")


def start_time(pid: int) -> str:
    """When `pid` started (clock ticks since boot): with the pid, it names one process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()[19]
    except (OSError, IndexError):
        return "gone"


def registered() -> dict[int, tuple[str, int]]:
    """pid -> (role, the pid it was forked for) of every forked process still alive."""
    found = {}
    for name in os.listdir(_registry) if _registry is not None else []:
        try:
            with open(os.path.join(_registry, name)) as f:
                role, parent, started = f.read().split()
        except (OSError, ValueError):
            continue  # being written
        if start_time(int(name)) == started:
            found[int(name)] = (role, int(parent))
    return found


_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload([*PRELOAD, __name__])


class _Fd:
    """A file descriptor handed to the child over the fork server's socket (SCM_RIGHTS), as
    multiprocessing hands a Connection: duplicated while the Process is pickled."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _rebuild_fd, (multiprocessing.reduction.DupFd(self.fd),)


def _rebuild_fd(dup) -> int:
    return dup.detach()


CLONE_NEWNET = 0x40000000

# The network namespace this process's forks enter (None: the fork server's own). A forked command
# started in a namespace (command(netns=...)) sets it, so the local workers it starts join it too.
_netns: str | None = None


def _enter_netns(name: str | None) -> None:
    """Move this (single-threaded, just forked) process into network namespace `name`, as `ip netns
    exec` does first (setns on /var/run/netns/NAME; os.setns is Python 3.12's, so libc's through
    ctypes). Threads it starts later are created in it too. What `ip netns exec` adds and a fork
    skips: a private mount namespace with /sys remounted to show the namespace's interfaces, and
    /etc/netns/NAME's files bound over /etc (none exist here); the tests' processes use neither."""
    global _netns
    if name is None:
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)
    _netns = name


def _worker(args: list[str], env: dict[str, str], log_fd: int, stdin: bytes | None, netns: str | None) -> None:
    """The child: the worker's session, environment, output and stdin, then `fusion worker ARGS`."""
    _enter_netns(netns)
    # A worker forks nothing: it lets go of the fork server's alive pipe, so the server ends when the
    # test process and the forked commands have, and PR_SET_PDEATHSIG then ends the worker.
    os.close(multiprocessing.forkserver._forkserver._forkserver_alive_fd)  # type: ignore[arg-type]
    multiprocessing.forkserver._forkserver._forkserver_alive_fd = None
    os.setsid()
    from fusion_compute.runtime.launch import die_with_parent

    die_with_parent()
    os.environ.clear()
    os.environ.update(env)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    if stdin is not None:  # small (a PEM bundle): it fits the pipe's buffer before anyone reads
        r, w = os.pipe()
        os.write(w, stdin)
        os.close(w)
        os.dup2(r, 0)
        os.close(r)
    sys.stdin = open(0, closefd=False) if stdin is not None else open(os.devnull)
    sys.stdout = open(1, "w", closefd=False, buffering=1)
    sys.stderr = open(2, "w", closefd=False, buffering=1)
    from fusion_compute.cli.main import main

    sys.exit(main(["worker", *args]))


class ForkedWorker:
    """subprocess.Popen's face (runtime.launch.Proc) over a forked multiprocessing.Process.

    A forked Process holds two pipe descriptors in this process (its exit status and the fork
    server's request) until it is closed: once its exit is known it is closed here and the status
    kept, as a Popen'd worker holds none, so a test process that starts hundreds of workers holds
    descriptors for the live ones only."""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        self._p = process
        assert process.pid is not None
        self.pid: int = process.pid
        self._code: int | None = None
        self._lock = threading.Lock()

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        with self._lock:
            if self._code is None and not self._p.is_alive():
                self._release()
            return self._code

    def _release(self) -> None:
        code = self._p.exitcode
        assert code is not None
        self._code = code
        self._p.close()

    def wait(self, timeout: float | None = None) -> int:
        if self._code is None:  # (not under the lock: another thread's poll must not wait for this one)
            try:
                self._p.join(timeout)
            except ValueError:
                pass  # another thread saw the exit and closed it meanwhile
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout or 0)
        return code

    def terminate(self) -> None:
        with self._lock:
            if self._code is None and self._p.exitcode is None:
                self._p.terminate()

    def kill(self) -> None:
        with self._lock:
            if self._code is None and self._p.exitcode is None:
                self._p.kill()


def _start(p: multiprocessing.process.BaseProcess, role: str) -> None:
    """Start `p`, make its exit status safe to read from several threads, write it down."""
    p.start()
    popen: Any = p._popen  # type: ignore[attr-defined]
    lock = threading.Lock()

    # multiprocessing's popen_forkserver.Popen.poll is not thread-safe: the exit status is 8 bytes on
    # a pipe, and a second thread that finds the pipe ready after the first has read them takes the
    # EOF for a lost fork server and records 255. WorkerProcs's watchdog and the thread stopping a
    # job both poll, and Process.start polls every other child; so one reader at a time.
    def poll(flag: int = os.WNOHANG) -> int | None:
        if popen.returncode is None:
            if not multiprocessing.connection.wait([popen.sentinel], 0 if flag == os.WNOHANG else None):
                return None
            with lock:
                if popen.returncode is None:
                    try:
                        popen.returncode = multiprocessing.forkserver.read_signed(popen.sentinel)
                    except (OSError, EOFError):
                        popen.returncode = 255  # as multiprocessing: the fork server itself is gone
        return popen.returncode

    popen.poll = poll
    assert p.pid is not None
    _register(p.pid, role)


def forked_worker(args: list[str], env: dict[str, str], log: IO[bytes], stdin: bytes | None) -> ForkedWorker:
    """runtime.launch's Launcher: `fusion worker ARGS`, forked from the fork server."""
    p = _context.Process(target=_worker, args=(args, env, _Fd(log.fileno()), stdin, _netns), daemon=True)
    _start(p, "worker")
    return ForkedWorker(p)


# The spawn function a job of this process gets when its options name none (fork_workers); None:
# the runtime's own, a fresh `python -m fusion_compute worker` (conftest's `real_workers`).
default_spawn: list[Any] = [forked_worker]


def fork_workers() -> None:
    """Every EngineOptions (and subclass) made in this process from now on starts its local workers
    with `default_spawn[0]` unless it names its own `spawn`. The runtime keeps no such default (the
    local executor takes the function it is given); this wraps the options' constructors, in the
    test process and in each forked command, so that ~60 places need not each pass it."""
    from fusion_compute.masked.options import MaskedOptions
    from fusion_compute.runtime.engine_options import EngineOptions

    for cls in (EngineOptions, MaskedOptions):
        init = cls.__init__
        if getattr(init, "_forked", False):
            continue

        def __init__(self, *args, _init=init, **kw):
            kw.setdefault("spawn", default_spawn[0])
            _init(self, *args, **kw)

        __init__._forked = True  # type: ignore[attr-defined]
        cls.__init__ = __init__  # type: ignore[method-assign]


def _command(
    args: list[str],
    env: dict[str, str],
    cwd: str | None,
    fds: list[int],
    registry: str | None,
    netns: str | None,
    code: str | None,
) -> None:
    """The child: `fusion ARGS` (or, given `code`, `python -c CODE ARGS`) on the given stdin, stdout
    and stderr, in network namespace `netns` if given, ended as the interpreter ends."""
    _enter_netns(netns)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    sys.stdin = sys.__stdin__ = open(0, closefd=False)
    sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)  # line-buffered on a terminal only, as Python's
    sys.stderr = sys.__stderr__ = open(2, "w", closefd=False, buffering=1, errors="backslashreplace")
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    sys.argv = ["fusion", *args] if code is None else ["-c", *args]
    # Its workers come from this fork server too: reuse it (the child knows its address and holds a
    # copy of the alive pipe) instead of starting another; and multiprocessing's exit handler, which
    # would stop them at exit, is not the interpreter's: a command leaves them as a real one would.
    multiprocessing.forkserver._forkserver.ensure_running = lambda: None  # type: ignore[method-assign]
    multiprocessing.process.current_process()._config["daemon"] = False
    atexit.unregister(multiprocessing.util._exit_function)
    from fusion_compute.cli.main import main

    fork_workers()
    if registry is not None:
        use_registry(registry)
    interrupted = False
    status: Any = None
    try:
        if code is None:
            status = main(args)
        else:  # as `python -c`: the code runs as __main__
            import builtins

            exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as e:
        status = e.code
    except KeyboardInterrupt:
        interrupted, status = True, 1
        traceback.print_exc()
    except BaseException:
        traceback.print_exc()
        status = 1
    if status is not None and not isinstance(status, int):  # the interpreter's own exit steps, in its order
        print(status, file=sys.stderr)
        status = 1
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:
            status = 120  # as CPython when flushing stdout fails at exit
    if interrupted:  # as CPython: an uncaught KeyboardInterrupt ends the process by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit((status or 0) & 0xFF)


class ForkedCommand(ForkedWorker):
    """subprocess.Popen's face over a forked `fusion ARGS` (what the suite's tests use of it)."""

    def __init__(self, process, args: list[str], stdin: IO | None, stdout: IO | None, stderr: IO | None):
        super().__init__(process)
        self.args = args
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self._readers: list[threading.Thread] = []
        self._output: dict[int, Any] = {}

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: not once its exit is known
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass  # it exited meanwhile (the fork server reaps at once)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """As Popen.communicate: feeds `input` and closes stdin, reads stdout and stderr to their
        end, waits; raises subprocess.TimeoutExpired after `timeout` s (call again to go on)."""
        if not self._readers:
            if self.stdin is not None:
                stdin, self.stdin = self.stdin, None

                def feed() -> None:
                    try:
                        if input:
                            stdin.write(input)
                        stdin.close()
                    except OSError:
                        pass  # it exited without reading: Popen ignores a broken pipe too

                self._readers.append(threading.Thread(target=feed, daemon=True))
            for i, stream in ((1, self.stdout), (2, self.stderr)):
                if stream is not None:
                    self._readers.append(threading.Thread(target=self._read, args=(i, stream), daemon=True))
            for t in self._readers:
                t.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for out in self._output.values():
            if isinstance(out, Exception):
                raise out
        return self._output.get(1), self._output.get(2)

    def _read(self, i: int, stream: IO) -> None:
        try:
            self._output[i] = stream.read()
        except Exception as e:  # e.g. undecodable text: raised to the caller, as Popen does
            self._output[i] = e
        stream.close()


def command(
    args: list[str],
    *,
    stdin: Any = None,
    stdout: Any = None,
    stderr: Any = None,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    text: bool = True,
    netns: str | None = None,
    code: str | None = None,
) -> ForkedCommand:
    """`fusion ARGS` forked from the fork server; the streams take what subprocess.Popen takes
    (None: this process's own, PIPE, DEVNULL, a file or a descriptor; stderr also STDOUT). `netns`:
    in that network namespace (as `ip netns exec NAME`), the workers it starts too; `code`: `python
    -c CODE ARGS` instead of `fusion ARGS`."""
    child: list[int] = []  # its fds 0, 1 and 2, as this process holds them
    mine: list[IO | None] = []  # the pipe ends this process keeps
    close: list[int] = []  # what to close here once the child holds its copies
    for target, spec in enumerate((stdin, stdout, stderr)):
        if spec is None:
            child.append(target)
            mine.append(None)
        elif spec == subprocess.STDOUT and target == 2:
            child.append(child[1])
            mine.append(None)
        elif spec == subprocess.DEVNULL:
            fd = os.open(os.devnull, os.O_RDWR)
            child.append(fd)
            close.append(fd)
            mine.append(None)
        elif spec == subprocess.PIPE:
            r, w = os.pipe()
            theirs, ours = (r, w) if target == 0 else (w, r)
            child.append(theirs)
            close.append(theirs)
            mode = ("w" if target == 0 else "r") + ("" if text else "b")
            mine.append(open(ours, mode))
        else:
            child.append(spec if isinstance(spec, int) else spec.fileno())
            mine.append(None)
    env = dict(os.environ if env is None else env)
    where = None if cwd is None else os.fspath(cwd)
    fds = [_Fd(fd) for fd in child]
    p = _context.Process(target=_command, args=(list(args), env, where, fds, _registry, netns, code), daemon=True)
    try:
        _start(
            p, "worker" if code is None and args[:1] == ["worker"] else "command"
        )  # as `pgrep -f "fusion_compute worker"`
    except BaseException:
        for stream in mine:
            if stream is not None:
                stream.close()
        raise
    finally:
        for fd in close:
            os.close(fd)
    return ForkedCommand(p, list(args), *mine)


def helper_pids() -> set[int]:
    """The fork server's and multiprocessing's resource tracker's pids, those started so far: the
    test process's own children for the whole run (the forked workers are the fork server's)."""
    from multiprocessing import forkserver, resource_tracker

    pids = {getattr(forkserver._forkserver, "_forkserver_pid", None)}
    pids.add(getattr(resource_tracker._resource_tracker, "_pid", None))
    return {p for p in pids if p is not None}
