"""Starting the tritonserver that ships in the `nvidia-pytriton` wheel
(docs/design.md#starting-tritonserver).

- The backend directory is made in a temporary folder: links to the wheel's libtriton_python.so
  and triton_python_backend_utils.py, and a copy of the stub built for this Python. The stub's
  RPATH does not reach the wheel's libraries from there, so LD_LIBRARY_PATH names them.
- The stub runs the first python3 on PATH: this environment's bin goes first.
- This Python's own LIBDIR goes first on LD_LIBRARY_PATH, or the stub may load another build of
  libpython3.X and fail to import ssl.
- Loopback addresses by default, a short exit timeout (an open sequence makes a graceful
  shutdown wait the whole timeout), readiness polled over HTTP.
- Triton's admin APIs (model-repository, shared-memory, trace, logging: loading models, mapping
  shared memory, changing the log level) are restricted by default on HTTP and gRPC: a request
  to them needs the header `tlaloc-admin-key` with the server's admin key (random unless given,
  so nobody has it). Health, metadata, inference, model configuration and statistics stay open.
- The Python backend's shared-memory regions get a prefix of this server's own, so that what a
  server stopped at its exit timeout leaves in /dev/shm (its stubs are killed, not unloaded)
  is removed once it has exited, and a stub still running a few seconds after it (one can
  deadlock in its own teardown) is killed.
- Each model instance runs in a process of its own (the Python backend's stub, a child of
  tritonserver). Triton 2.51 never notices a stub that died: the model stays ready, its
  in-flight requests are never answered and new ones fail. `stub_processes` and `dead_stubs`
  let a supervisor (`tlaloc serve`) see it from /proc.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


log = logging.getLogger("triton_tlaloc.server")


class ServerError(RuntimeError):
    pass


STUB_NAME = "triton_python_backend_stub"


@dataclass(frozen=True)
class StubProcess:
    """One model instance's process: its pid and the model it serves (the stub's first
    argument is REPO/MODEL/VERSION/model.py)."""

    pid: int
    model: str


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process from /proc, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces
    except OSError:
        return None
    return fields[0], int(fields[1])


def _processes():
    """(pid, parent pid, argv) of every process /proc shows, ascending by pid."""
    for pid in sorted(int(e) for e in os.listdir("/proc") if e.isdigit()):
        stat = _proc_stat(pid)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if stat is not None and argv:
            yield pid, stat[1], argv


def processes_named(name: str, parent: int | None = None) -> list[int]:
    """The pids whose command is `name` (children of `parent` when given), ascending."""
    return [pid for pid, ppid, argv in _processes()
            if Path(argv[0]).name == name and parent in (None, ppid)]


def servers_mentioning(text: str) -> list[tuple[int, str]]:
    """(pid, command name) of the live tritonservers and model processes (stubs) whose
    arguments mention `text` (a folder their repository lies in)."""
    return [(pid, Path(argv[0]).name) for pid, _, argv in _processes()
            if Path(argv[0]).name in ("tritonserver", STUB_NAME)
            and any(text in a for a in argv[1:]) and not _exited(pid)]


def stub_processes(parent: int) -> list[StubProcess]:
    """The Python-backend stubs whose parent is `parent` (a tritonserver), read from /proc."""
    return [StubProcess(pid, Path(argv[1]).parent.parent.name)
            for pid, ppid, argv in _processes()
            if ppid == parent and Path(argv[0]).name == STUB_NAME and len(argv) > 1]


def stubs_with_prefix(prefix: str) -> list[int]:
    """The live (not zombie) stubs whose arguments hold the shared-memory prefix `prefix`: a
    stopped server's, whoever their parent is now."""
    return [pid for pid, _, argv in _processes()
            if Path(argv[0]).name == STUB_NAME and any(prefix in a for a in argv[1:])
            and not _exited(pid)]


def end_stubs(prefix: str, grace_s: float = 5.0) -> int:
    """Kill the stubs under `prefix` (a stopped server's) that have not exited `grace_s` from
    now; how many were killed. A stub whose tritonserver exited at its exit timeout can
    deadlock in its own teardown and sleep for good, holding its model's memory (Triton 2.51,
    seen in test runs: its health thread, seeing the parent gone, blocks on a lock in the
    stub's teardown while the main thread waits for a message from the parent). Found by the
    prefix in their arguments, so no other process is hit."""
    deadline = time.monotonic() + grace_s
    while (left := stubs_with_prefix(prefix)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # until they are gone (a SIGKILLed process takes a moment to exit), so callers find none
    deadline = time.monotonic() + 2.0
    while stubs_with_prefix(prefix) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(left)


def dead_stubs(stubs: list[StubProcess]) -> list[StubProcess]:
    """Those of `stubs` that have exited (gone, or a zombie its parent has not reaped)."""
    return [s for s in stubs if _exited(s.pid)]


def _exited(pid: int) -> bool:
    """Gone, or a zombie its parent has not reaped."""
    return (stat := _proc_stat(pid)) is None or stat[0] in "ZX"


# The APIs a client needs no key for are the rest: health, metadata, inference, model-config,
# statistics.
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")
ADMIN_KEY_HEADER = "tlaloc-admin-key"
# The server's admin key in its environment and its model processes': `tlaloc serve`, `tlaloc
# openai` and the sequence model (its adapter loads and unloads) read it from there.
ADMIN_KEY_ENV = "TLALOC_ADMIN_KEY"
SHM_DIR = Path("/dev/shm")


def pytriton_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("nvidia-pytriton is not installed: it carries the tritonserver binary")
    return Path(list(spec.submodule_search_locations)[0]) / "tritonserver"


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n different free loopback ports. Each socket stays bound until all are picked: a port
    released is the kernel's to give again at once, and three picks in a row once gave gRPC
    and metrics the same port (tritonserver then refuses to start)."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def server_environment() -> dict:
    site = pytriton_dir().parent.parent
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    libs = [sysconfig.get_config_var("LIBDIR") or "", str(site / "nvidia_pytriton.libs"),
            env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in libs if p)
    return env


def make_backend_dir(root: Path) -> Path:
    triton = pytriton_dir()
    backend = root / "backends" / "python"
    backend.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        link = backend / name
        if not link.exists():
            link.symlink_to(triton / "backends" / "python" / name)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = triton / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"the wheel has no Python backend stub for Python {version}")
    shutil.copy2(stub, backend / "triton_python_backend_stub")
    return root / "backends"


class TritonServer:
    """A tritonserver process serving REPO; a context manager that stops it on exit."""

    def __init__(self, repo: str | os.PathLike, *, host: str = "127.0.0.1",
                 http_port: int | None = None, grpc_port: int | None = None,
                 metrics_port: int | None = None, log_path: str | os.PathLike | None = None,
                 exit_timeout_s: int = 5, log_verbose: int = 0, extra_args: tuple = (),
                 restrict_admin: bool = True, admin_key: str | None = None):
        self.repo = Path(repo).resolve()
        self.host = host
        picked = iter(free_ports(3))
        self.http_port = http_port or next(picked)
        self.grpc_port = grpc_port or next(picked)
        self.metrics_port = metrics_port or next(picked)
        self.exit_timeout_s = exit_timeout_s
        self._tmp = Path(tempfile.mkdtemp(prefix="tlaloc-triton-"))
        self.log_path = Path(log_path) if log_path else self._tmp / "tritonserver.log"
        self.admin_key = admin_key or secrets.token_hex(16)
        self.shm_prefix = f"tlaloc_{secrets.token_hex(6)}_"
        restricted = []
        if restrict_admin:
            rule = f"{','.join(RESTRICTED_APIS)}:{ADMIN_KEY_HEADER}={self.admin_key}"
            restricted = [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]
        self.args = [
            str(pytriton_dir() / "bin" / "tritonserver"),
            "--model-repository", str(self.repo),
            "--backend-directory", str(make_backend_dir(self._tmp)),
            "--http-address", host, "--http-port", str(self.http_port),
            "--grpc-address", host, "--grpc-port", str(self.grpc_port),
            "--metrics-address", host, "--metrics-port", str(self.metrics_port),
            "--exit-timeout-secs", str(exit_timeout_s),
            "--log-verbose", str(log_verbose),
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            *restricted,
            *extra_args,
        ]
        self.proc: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    # Triton's Python backend now and then aborts the whole server while it starts a model's
    # process: a mutex in the shared memory it sets up for the process throws (seen once in
    # this project's test runs, as it initialized a model instance; reported upstream against
    # several Triton releases). The abort is in Triton's own code; a second start works.
    SHM_LOCK_ABORT = "boost::interprocess::lock_exception"

    def start(self, timeout_s: float = 300.0, wait_compiled: bool = True,
              progress=None) -> "TritonServer":
        """Start tritonserver and wait until it is ready, and with `wait_compiled` until every
        model has compiled all its entries (they compile in the background once a model is
        ready). `progress(line)` is given each line of the log that tells the load's
        progress (`progress_lines`). A server that Triton's Python backend aborted while
        starting (`SHM_LOCK_ABORT`) is started once more."""
        try:
            return self._start(timeout_s, wait_compiled, progress)
        except ServerError as e:
            if self.SHM_LOCK_ABORT not in str(e):
                raise
            log.warning("tritonserver aborted as it started a model process (%s); starting "
                        "it again", self.SHM_LOCK_ABORT)
            make_backend_dir(self._tmp)  # stop() removed it
            return self._start(timeout_s, wait_compiled, progress)

    def _start(self, timeout_s: float, wait_compiled: bool, progress) -> "TritonServer":
        self._log = open(self.log_path, "ab")
        self._read_to = self._log_start = self.log_path.stat().st_size
        # The model processes read the admin key from their environment: a sequence model's
        # adapter loads and unloads (the request parameter lora_admin) need it too.
        env = {**server_environment(), ADMIN_KEY_ENV: self.admin_key}
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                failed = "".join(f"\n  model {name} failed to load: {why}"
                                 for name, why in self.load_failures())
                message = (f"tritonserver exited with {self.proc.returncode}{failed}\n"
                           f"its log's last lines:\n{self.log_tail()}")
                self.stop()  # its log closed, its backend folder and shared memory removed
                raise ServerError(message)
            if progress is not None:
                for line in self.progress_lines():
                    progress(line)
            if self.ready() and (not wait_compiled or self.compiled()):
                return self
            time.sleep(0.25)
        self.stop()
        raise ServerError(f"tritonserver not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def compiled(self) -> bool:
        """Whether every model compiling entries in the background has finished (its load
        logged "compile in the background" and its compile threads "background compiles
        done")."""
        text = self._run_log()
        return text.count("compile in the background on") == text.count(
            "background compiles done")

    def _run_log(self) -> str:
        """What this run wrote to the log (a log file given may hold earlier runs' lines)."""
        with open(self.log_path, "rb") as f:
            f.seek(self._log_start)
            return f.read().decode(errors="replace")

    PROGRESS = re.compile(r"entry \S+: (compiled|loaded)|weights: |KV pools: |"
                          r"ready in |compile in the background|background compiles done|"
                          r"failed to compile|host tier: |resident memory ")

    def progress_lines(self) -> list[str]:
        """The log lines about the load written since the last call (entries compiled, weights
        uploaded, models ready, background compiles), each cut to its message."""
        if not self.log_path.exists():
            return []
        with open(self.log_path, "rb") as f:
            f.seek(self._read_to)
            data = f.read()
        end = data.rfind(b"\n") + 1  # whole lines only
        self._read_to += end
        lines = data[:end].decode(errors="replace").splitlines()
        return [line.split("] ", 1)[-1].strip().strip('"') for line in lines
                if self.PROGRESS.search(line)]

    def stub_resident_bytes(self) -> int:
        """Resident memory of the Python backend stubs this server started (one process per
        model instance: where the models' weights, pools and executables live), from /proc."""
        total = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                cmd = (stat.parent / "cmdline").read_bytes()
            except OSError:
                continue
            if (self.proc is not None and int(fields[1]) == self.proc.pid
                    and b"triton_python_backend_stub" in cmd):
                total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        return total

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    LOAD_FAILURE = re.compile(r"failed to load '([^']+)' version \d+: (.*?)(?:\\n|\"?$)")

    def load_failures(self) -> list[tuple[str, str]]:
        """(model, its error's first line) for each model this run's log says failed to load:
        what a user needs of a log whose last line says only "failed to load all models"."""
        return [(m.group(1), m.group(2).strip()) for line in self._run_log().splitlines()
                if (m := self.LOAD_FAILURE.search(line))]

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGINT, then SIGKILL to its process group (its stubs too) when it has not exited
        `grace_s` past its exit timeout. (With a model's process dead, tritonserver logs
        "Exiting immediately" at its exit timeout and then hangs: a supervisor replacing it
        passes a short grace.)"""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(self.exit_timeout_s + grace_s)
            except subprocess.TimeoutExpired:
                log.warning("tritonserver (pid %d) had not exited %.0f s after SIGINT: killed "
                            "with its process group", self.proc.pid, self.exit_timeout_s + grace_s)
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        if killed := end_stubs(self.shm_prefix):
            log.warning("killed %d model process(es) still running after tritonserver exited",
                        killed)
        shutil.rmtree(self._tmp / "backends", ignore_errors=True)
        for region in self.shm_regions():  # left when the exit timeout killed the stubs
            region.unlink(missing_ok=True)
        return self.proc.returncode

    def shm_regions(self) -> list[Path]:
        """This server's Python-backend shared-memory files in /dev/shm."""
        return sorted(SHM_DIR.glob(f"{self.shm_prefix}*"))

    def __enter__(self) -> "TritonServer":
        """Starts the server with `start`'s defaults, unless it was started already
        (`with TritonServer(repo).start(wait_compiled=False) as server:`)."""
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
