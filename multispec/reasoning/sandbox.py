"""Run generated Python programs so that a bad one is a failed sample, never a failed evaluation.

Each program runs in its own interpreter process and session (so its process group can be killed
whole), in a fresh temporary directory that is also its HOME and TMPDIR and is removed after,
with an environment that carries nothing of the caller's, under rlimits on CPU time, address
space, processes, file size and core dumps, with its output capped and, where the platform
allows it, in a network namespace of its own; elsewhere an audit hook refuses socket creation,
which guards against accidents only. As root, programs run as ``nobody``: root is exempt from
the process limit and could write anywhere. ``isolation()`` says what is in force on this host;
docs/sandbox.md says what is contained and what is not.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from multispec.params import check_int, check_real

__all__ = ["ExecutionResult", "Isolation", "isolation", "run_python"]

log = logging.getLogger("multispec")

NOBODY = 65534
"""The uid and gid programs run as when the caller is root."""
FILE_SIZE_LIMIT = 64 << 20
"""RLIMIT_FSIZE: no program needs to write more than this into one file."""
SETUP_FAILED = 125
"""Exit status of the child when confining it failed, before the program ran."""
EXIT_GRACE = 0.5
"""Seconds to keep reading after the program exited, while leftover children hold its pipes."""
ENVIRONMENT = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONIOENCODING": "utf-8",
    # One thread per numeric library: thread pools reserve address space (RLIMIT_AS) and CPU.
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
"""The whole environment of a program, plus HOME and TMPDIR (its directory): nothing inherited."""


@dataclass
class ExecutionResult:
    """How a program ended. ``status``: "passed" (exit status 0 within every limit), "failed"
    (non-zero exit, killed by a signal, a limit hit, output over the cap), "timeout" (the wall
    clock or the CPU limit) or "error" (it could not be started or confined)."""

    passed: bool
    status: str
    stdout: str
    stderr: str
    seconds: float


@dataclass(frozen=True)
class Isolation:
    """What confines programs on this host: the interpreter that runs them, the uid they run as
    (None: the caller's) and the network isolation ("namespace" or "socket-guard")."""

    python: str
    user: int | None
    network: str

    @property
    def process_limit(self) -> bool:
        """False only for root programs: the kernel exempts uid 0 from RLIMIT_NPROC."""
        return self.user is not None or os.geteuid() != 0


def run_python(program: str, *, timeout: float = 10.0, memory_mb: int = 1024, max_processes: int = 64,
               max_output_bytes: int = 65536) -> ExecutionResult:
    """Run ``program`` (Python source) as ``__main__`` in a confined child; see the module docstring.

    ``timeout`` is wall-clock seconds for the whole process group (the CPU limit is the same
    number of CPU seconds per process); ``memory_mb`` caps each process's address space;
    ``max_processes`` caps the program's processes and threads, counted over and above those the
    user already runs (RLIMIT_NPROC counts every process of a uid: a cap on the total would make
    ordinary programs fail whenever the user runs many others); ``max_output_bytes`` caps stdout
    and stderr each, and the program is killed when it writes more. Bad arguments raise
    ValueError; whatever the program does gives a result.
    """
    if not isinstance(program, str):
        raise ValueError(f"program={program!r:.80}: must be Python source text")
    timeout = check_real("timeout", timeout, "must be a finite number of seconds > 0", lambda t: t > 0)
    limits = {"cpu_seconds": math.ceil(timeout), "memory_bytes": check_int("memory_mb", memory_mb, 16) << 20,
              "max_processes": check_int("max_processes", max_processes, 1), "file_size": FILE_SIZE_LIMIT}
    cap = check_int("max_output_bytes", max_output_bytes, 0)
    return _run(program, isolation(), limits, timeout, cap)


_isolation: Isolation | None = None
_isolation_lock = threading.Lock()


def isolation() -> Isolation:
    """What this host allows, probed once per process by running two trivial programs."""
    global _isolation
    with _isolation_lock:
        if _isolation is None:
            _isolation = _probe()
            log.info("sandbox: python %s, user %s, network %s", _isolation.python,
                     "caller's" if _isolation.user is None else _isolation.user, _isolation.network)
            if not _isolation.process_limit:
                log.warning("sandbox: no interpreter runs as nobody, so programs run as root, which the process "
                            "limit does not bind")
    return _isolation


def _probe() -> Isolation:
    """The first interpreter that runs as ``nobody`` when we are root (ours may sit in a directory
    only root can enter, as with a Python installed under /root; then the python3 on the programs'
    PATH), then whether a network namespace can be created."""
    limits = {"cpu_seconds": 10, "memory_bytes": 1 << 30, "max_processes": 8, "file_size": FILE_SIZE_LIMIT}
    chosen = Isolation(sys.executable, None, "socket-guard")
    if os.geteuid() == 0:
        system = shutil.which("python3", path=ENVIRONMENT["PATH"])
        for python in dict.fromkeys(p for p in (sys.executable, system) if p):
            candidate = Isolation(python, NOBODY, "socket-guard")
            if _run("pass", candidate, limits, 10.0, 4096).passed:
                chosen = candidate
                break
    namespaced = Isolation(chosen.python, chosen.user, "namespace")
    return namespaced if _run("pass", namespaced, limits, 10.0, 4096).passed else chosen


def _run(program: str, where: Isolation, limits: dict, timeout: float, cap: int) -> ExecutionResult:
    """Write the program into a fresh directory, run it confined, collect, clean up."""
    start = time.monotonic()
    directory = tempfile.mkdtemp(prefix="multispec-sandbox-")
    try:
        path = os.path.join(directory, "main.py")
        with open(path, "w", encoding="utf-8") as file:
            file.write(program)
        if where.user is not None:
            os.chown(directory, where.user, where.user)
            os.chown(path, where.user, where.user)
        settings = dict(limits, program=path, network=where.network, setup_failed=SETUP_FAILED)
        try:
            child = subprocess.Popen(
                [where.python, "-I", "-B", "-c", _child_source(settings)], cwd=directory, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(ENVIRONMENT, HOME=directory, TMPDIR=directory),
                start_new_session=True, user=where.user, group=where.user,
                extra_groups=[] if where.user is not None else None)
        except OSError as error:
            return ExecutionResult(False, "error", "", f"sandbox: cannot start {where.python}: {error}",
                                   time.monotonic() - start)
        stdout, stderr, ended = _collect(child, start + timeout, cap)
        status, note = _verdict(child.returncode, ended, timeout, cap)
        text = stderr[:cap].decode("utf-8", "replace") + (f"\n[sandbox: {note}]" if note else "")
        return ExecutionResult(status == "passed", status, stdout[:cap].decode("utf-8", "replace"), text,
                               time.monotonic() - start)
    finally:
        _remove_tree(directory)


def _collect(child: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, str | None]:
    """Read both pipes until the program has exited and they are closed (or, when leftover
    children hold them, ``EXIT_GRACE`` after), the deadline passes or one exceeds ``cap``; then
    kill the process group, leftovers included, and reap the child. Returns the output and why
    reading stopped early ("timeout", "output", or None)."""
    buffers = {child.stdout: bytearray(), child.stderr: bytearray()}
    selector = selectors.DefaultSelector()
    for pipe in buffers:
        selector.register(pipe, selectors.EVENT_READ)
    ended, exited_at = None, None
    try:
        while ended is None:
            now = time.monotonic()
            if exited_at is None and _has_exited(child.pid):
                exited_at = now
            if exited_at is not None and (not selector.get_map() or now - exited_at > EXIT_GRACE):
                break
            if now >= deadline:
                ended = "timeout"
                break
            for key, _ in selector.select(min(deadline - now, 0.05 if selector.get_map() else 0.01)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffers[key.fileobj] += chunk
                if len(buffers[key.fileobj]) > cap:
                    ended = "output"
    finally:
        selector.close()
        _kill_group(child.pid)
        child.wait()
        for pipe in buffers:
            pipe.close()
    return bytes(buffers[child.stdout]), bytes(buffers[child.stderr]), ended


def _has_exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it: until it is reaped its pid, and so its
    process group id, cannot be reused, and killing the group cannot hit a stranger."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _verdict(returncode: int, ended: str | None, timeout: float, cap: int) -> tuple[str, str | None]:
    """The status and, when a limit ended the run, a note for stderr."""
    if ended == "timeout":
        return "timeout", f"wall-clock timeout after {timeout:g}s; process group killed"
    if ended == "output":
        return "failed", f"output over {cap} bytes; process group killed"
    if returncode == -signal.SIGXCPU:
        return "timeout", "CPU time limit reached"
    if returncode == SETUP_FAILED:
        return "error", None
    if returncode < 0:
        return "failed", f"killed by {signal.Signals(-returncode).name}"
    return ("passed", None) if returncode == 0 else ("failed", None)


def _kill_group(pgid: int) -> None:
    """SIGKILL the group and wait (up to ``EXIT_GRACE``) until none of it runs: the signal is
    delivered asynchronously, and dying processes still count against the next program's
    process limit."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    give_up = time.monotonic() + EXIT_GRACE
    while group_running(pgid) and time.monotonic() < give_up:
        time.sleep(0.01)


def group_running(pgid: int) -> bool:
    """Whether a live (not zombie) process of group ``pgid`` remains."""
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as file:
                fields = file.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def _remove_tree(directory: str) -> None:
    """Remove the program's directory even where it took away its own permissions."""

    def unlock(function, path, _):
        os.chmod(os.path.dirname(path), stat.S_IRWXU)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, stat.S_IRWXU)
            shutil.rmtree(path, onerror=unlock)
        else:
            function(path)

    shutil.rmtree(directory, onerror=unlock)


# What follows runs inside the child, in whatever interpreter runs programs (``isolation().python``,
# maybe not ours): standard library only, no annotations, each function self-contained.

def _child_source(settings: dict) -> str:
    """The child's ``-c`` script: the functions below and a call of the entry point."""
    functions = (_tasks_of, _set_limits, _enter_network_namespace, _refuse_sockets, _confine_and_run)
    return "\n\n".join(inspect.getsource(f) for f in functions) + f"\n_confine_and_run({settings!r})\n"


def _tasks_of(uid):
    """Processes and threads that ``uid`` runs now: RLIMIT_NPROC counts all of them."""
    import os

    count = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/" + name + "/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


def _set_limits(settings):
    """Every rlimit, each no higher than the hard limit already in force."""
    import os
    import resource

    wanted = {
        resource.RLIMIT_CPU: (settings["cpu_seconds"], settings["cpu_seconds"] + 1),
        resource.RLIMIT_AS: (settings["memory_bytes"],) * 2,
        resource.RLIMIT_FSIZE: (settings["file_size"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
        # This process is one of the uid's tasks already: it counts against the program's share.
        resource.RLIMIT_NPROC: (_tasks_of(os.getuid()) - 1 + settings["max_processes"],) * 2,
    }
    for which, (soft, hard) in wanted.items():
        ceiling = resource.getrlimit(which)[1]
        if ceiling != resource.RLIM_INFINITY:
            soft, hard = min(soft, ceiling), min(hard, ceiling)
        resource.setrlimit(which, (soft, hard))


def _enter_network_namespace():
    """A new user and network namespace: its one interface, loopback, is down, so no address can
    be reached. The user namespace lets an unprivileged uid create it; mapping our own ids keeps
    file ownership and permissions as they were; rlimits set before still bind."""
    import ctypes
    import os

    uid, gid = os.getuid(), os.getgid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x10000000 | 0x40000000) != 0:  # CLONE_NEWUSER | CLONE_NEWNET
        raise OSError(ctypes.get_errno(), "unshare: " + os.strerror(ctypes.get_errno()))
    for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid, uid)), ("gid_map", "%d %d 1" % (gid, gid))):
        with open("/proc/self/" + name, "w") as file:
            file.write(text)


def _refuse_sockets():
    """An audit hook that refuses network sockets and name lookups in this interpreter. Python
    code cannot remove it, but native code and child processes do not pass through it: a guard
    against accidents, not a security boundary."""
    import socket
    import sys

    lookups = {"socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo"}

    def hook(event, args):
        if (event == "socket.__new__" and args[1] != socket.AF_UNIX) or event in lookups:
            raise PermissionError("network access is disabled in the sandbox")

    sys.addaudithook(hook)


def _confine_and_run(settings):
    """Limits, then the network, then the program as ``__main__``. A setup failure exits with
    status ``setup_failed`` before the program runs."""
    import os
    import runpy
    import sys

    try:
        _set_limits(settings)
        if settings["network"] == "namespace":
            _enter_network_namespace()
        else:
            _refuse_sockets()
    except Exception as error:
        sys.stderr.write("sandbox: confining the program failed: %s\n" % error)
        sys.stderr.flush()
        os._exit(settings["setup_failed"])
    sys.argv = [settings["program"]]
    runpy.run_path(settings["program"], run_name="__main__")
