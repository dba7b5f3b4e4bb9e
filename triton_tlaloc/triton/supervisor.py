"""`tlaloc serve` and `tlaloc check-stubs`: a tritonserver kept serving. Triton keeps a model
whose Python-backend process died "ready" and never answers its requests; `serve` watches its
model processes and restarts the server when one dies, and `check-stubs` is the same check as a
liveness probe for a server something else started (a container's)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path


# Seconds past its exit timeout a tritonserver with a dead model process is given to exit
# before it is killed: it hangs after saying it exits, and its clients' streams with it.
RESTART_GRACE_S = 2.0


def serve(args) -> int:
    """`tlaloc serve`: tritonserver started, watched and restarted when a model's process dies;
    stopped on SIGINT or SIGTERM. The exit status: 0 stopped when asked, 1 the server exited on
    its own, 3 a model process kept dying."""
    from .server import (ADMIN_KEY_ENV, RESTRICTED_APIS, TritonServer, dead_stubs,
                         stub_processes)

    admin_key = args.admin_key or os.environ.get(ADMIN_KEY_ENV) or None
    if args.cpu_devices:  # every backend process inherits it (each instance its own devices)
        from ..runtime.pjrt import with_cpu_devices

        os.environ["XLA_FLAGS"] = with_cpu_devices(os.environ.get("XLA_FLAGS", ""),
                                                   args.cpu_devices)

    def progress(line):
        print(f"  {line}", file=sys.stderr, flush=True)

    def start() -> TritonServer:
        server = TritonServer(args.repo, host=args.host, http_port=args.http_port,
                              grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                              log_path=args.log_file, exit_timeout_s=args.exit_timeout,
                              restrict_admin=not args.open_admin_api, admin_key=admin_key)
        print(f"starting tritonserver (log: {server.log_path}) ...", file=sys.stderr, flush=True)
        server.start(timeout_s=args.start_timeout, wait_compiled=False, progress=progress)
        print(f"ready: HTTP {server.http_url}  gRPC {server.grpc_url}  metrics "
              f"{server.metrics_url}", flush=True)
        return server

    server = start()
    if args.open_admin_api:
        print("warning: Triton's admin APIs (model repository, shared memory, trace, logging) "
              "are open to every client", file=sys.stderr)
    elif admin_key is None:
        print(f"admin APIs ({', '.join(RESTRICTED_APIS)}) closed: no admin key was given",
              file=sys.stderr)
    stop = []
    # Explicit handlers: a shell starting us in the background may have SIGINT ignored.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(1))
    stubs, restarts = stub_processes(server.proc.pid), 0
    while not stop and server.proc.poll() is None:
        for line in server.progress_lines():  # the entries still compiling in the background
            progress(line)
        if dead := dead_stubs(stubs):
            # Triton keeps a model whose process died "ready" and never answers its requests:
            # stop the server (its other models' requests finish, the dead one's fail at the
            # exit timeout) and start it again, every model in a process of its own.
            died = ", ".join(f"{s.model} (pid {s.pid})" for s in dead)
            if restarts >= args.max_restarts:
                print(f"model process of {died} died, and tritonserver was restarted "
                      f"{restarts} times already: stopping (exit 3)", file=sys.stderr,
                      flush=True)
                server.stop(grace_s=RESTART_GRACE_S)
                return 3
            restarts += 1
            print(f"model process of {died} died: restarting tritonserver ({restarts} of at "
                  f"most {args.max_restarts})", file=sys.stderr, flush=True)
            server.stop(grace_s=RESTART_GRACE_S)
            server = start()
            stubs = stub_processes(server.proc.pid)
            continue
        time.sleep(0.2)
    if not stop:  # it exited on its own: that is a failure
        print(f"tritonserver exited with {server.proc.returncode}:\n{server.log_tail()}",
              file=sys.stderr)
        server.stop()
        return 1
    rc = server.stop()
    # Asked to stop, it exits 1 when open sequences outlived its exit timeout: that is the
    # stop we asked for, not a failure (their pages go with the process).
    how = "clean" if rc == 0 else "open sequences were dropped at the exit timeout"
    print(f"tritonserver stopped ({how})", file=sys.stderr)
    return 0


def check_stubs(args) -> int:
    """A liveness probe for a tritonserver not started by `tlaloc serve` (a container's): exit 1
    when a model process seen by an earlier run has died, or the server's live endpoint fails.
    The first run after the server is ready records its model processes in `--state`."""
    from .server import StubProcess, dead_stubs, processes_named, stub_processes

    try:
        with urllib.request.urlopen(f"http://{args.url}/v2/health/live", timeout=5) as r:
            live = r.status == 200
    except OSError as e:
        live, why = False, str(e)
    else:
        why = "not live"
    if not live:
        print(f"tritonserver at {args.url}: {why}", file=sys.stderr)
        return 1
    state = Path(args.state)
    if state.is_file():
        known = [StubProcess(**s) for s in json.loads(state.read_text())]
        if dead := dead_stubs(known):
            print("model process died: " + ", ".join(f"{s.model} (pid {s.pid})" for s in dead),
                  file=sys.stderr)
            return 1
        return 0
    # In a container tritonserver is pid 1: the lowest pid of that name
    pid = args.pid or next(iter(processes_named("tritonserver")), None)
    stubs = stub_processes(pid) if pid else []
    if stubs:  # none yet: the models are still loading, look again next time
        state.write_text(json.dumps([dataclasses.asdict(s) for s in stubs]))
    return 0
