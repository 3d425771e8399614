"""Run untrusted Python against stdin tests in a child process with time, memory and network limits.

    result = run_python("print(int(input()) * 2)", ["3\n", "5\n"], time_limit_s=2.0, memory_mb=256)
    result.outputs  # ['6\n', '10\n']

The child is `python -I -S` in a fresh temporary directory with an empty environment, in its own process
group (killed as a group at the wall-clock limit). It sets its own rlimits before reading the code (address
space, CPU seconds, file size, open files) rather than through `preexec_fn`, which is unsafe in threaded
parents such as an actor that runs blocking env steps in threads. Network: where unprivileged user
namespaces work (`unshare -rn`), the child runs in a new network namespace with no usable interface; elsewhere
`socket.socket` is replaced by a function that raises. This keeps honest mistakes (infinite loops, memory
hogs, stray writes) contained; it is not a security boundary against deliberately hostile code.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

# Runs inside the child. Limits first, then the payload from stdin: {"code": str, "inputs": [str]}.
_RUNNER = r"""
import io, json, resource, sys
mem, cpu = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
payload = json.loads(sys.stdin.read())
import socket
def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in the sandbox")
socket.socket = socket.create_connection = _no_network
real_stdout = sys.stdout
code = payload["code"]
results = []
for test_input in payload["inputs"]:
    out = io.StringIO()
    sys.stdin, sys.stdout = io.StringIO(test_input), out
    error = None
    try:
        exec(compile(code, "<solution>", "exec"), {"__name__": "__main__"})
    except SystemExit:
        pass
    except BaseException as exc:
        error = type(exc).__name__ + ": " + str(exc)[:200]
    finally:
        sys.stdin, sys.stdout = sys.__stdin__, real_stdout
    results.append({"stdout": out.getvalue()[:100000], "error": error})
real_stdout.write("\n" + json.dumps(results))
"""


@dataclass(frozen=True)
class RunResult:
    """What happened: `status` is ok (all inputs ran; see `errors`), timeout, or crash (killed by a signal
    or a limit, or output that is not the runner's)."""

    status: str
    outputs: list[str] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    wall_s: float = 0.0
    detail: str = ""


@functools.lru_cache(maxsize=1)
def _can_unshare_network() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    try:
        return subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def run_python(code: str, inputs: list[str], time_limit_s: float = 2.0, memory_mb: int = 256) -> RunResult:
    """Run `code` once per stdin string in `inputs`, all within `time_limit_s` wall seconds and `memory_mb`
    of address space. Never raises for anything the code does."""
    argv = [sys.executable, "-I", "-S", "-c", _RUNNER, str(memory_mb << 20), str(max(1, int(time_limit_s + 0.999)))]
    if _can_unshare_network():
        argv = ["unshare", "-rn", *argv]
    payload = json.dumps({"code": code, "inputs": inputs})
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="agentstream-sandbox-") as workdir:
        proc = subprocess.Popen(
            argv,
            cwd=workdir,
            env={"PATH": "/usr/bin:/bin", "HOME": workdir},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            text=True,
        )
        try:
            stdout, stderr = proc.communicate(payload, timeout=time_limit_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return RunResult("timeout", wall_s=time.monotonic() - start, detail=f"over {time_limit_s}s")
        finally:
            _kill_group(proc)  # also reaps anything the code left behind in its process group
    wall = time.monotonic() - start
    if proc.returncode == -signal.SIGXCPU:
        return RunResult("timeout", wall_s=wall, detail="CPU-time limit")
    if proc.returncode != 0:
        return RunResult("crash", wall_s=wall, detail=f"exit {proc.returncode}: {stderr[-300:]}")
    try:
        results = json.loads(stdout.rsplit("\n", 1)[-1])
        outputs, errors = [r["stdout"] for r in results], [r["error"] for r in results]
    except (ValueError, KeyError, TypeError):
        return RunResult("crash", wall_s=wall, detail="the runner's report is missing or malformed")
    return RunResult("ok", outputs, errors, wall)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def outputs_match(got: str, expected: str) -> bool:
    """Same lines after stripping trailing whitespace (as LiveCodeBench's stdin grader does)."""
    return [line.rstrip() for line in got.strip().splitlines()] == [
        line.rstrip() for line in expected.strip().splitlines()
    ]
