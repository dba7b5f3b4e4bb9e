"""A model's process ends when its tritonserver does, however it ends. Each model process (a
Python backend stub) is tritonserver's child. Triton's stubs watch their parent too, but a stub
whose server was SIGKILLed, or exited at its exit timeout, was seen to deadlock in its own
teardown and sleep for good, holding its model's memory (on a GPU, its weights and KV pools:
the next server then cannot load). Measured: a tiny llama and its generate model, tritonserver
SIGKILLed alone: 1 of the 2 stubs still alive 15 s later.

So each model process starts a watcher *process* of its own: a shell loop that, once the model
process's parent is no longer the tritonserver it started under (the server gone: the process
given to init), SIGKILLs it. Not a thread of the model process: a thread needs the
interpreter's lock, which a deadlocked teardown may hold (a watch thread was tried, and a
stub outlived its server with it); nor PR_SET_PDEATHSIG, which fires when the server's *thread*
that started the stub ends, not the server. The watcher ends with the model process.

`TLALOC_WATCH_PARENT=0` turns the watch off (the tests' control)."""

from __future__ import annotations

import logging
import os
import subprocess

log = logging.getLogger("triton_tlaloc")

WATCH_ENV = "TLALOC_WATCH_PARENT"
POLL_S = 1.0
# While PROCESS's parent (field 4 of /proc/PROCESS/stat, read by the shell itself: one `sleep`
# a poll is all it starts) is PARENT: wait; then, if PROCESS is still there, SIGKILL it. (The
# stub's command name has no space: the field count holds.)
WATCHER = ('while read -r _ _ _ ppid _ < /proc/{process}/stat && [ "$ppid" = "{parent}" ]; '
           'do sleep {poll}; done 2>/dev/null; [ -e /proc/{process} ] && kill -9 {process}')


def watch_parent(process: int | None = None, parent: int | None = None,
                 poll_s: float = POLL_S) -> subprocess.Popen | None:
    """Start the watcher of `process` (this one) under `parent` (its parent now); None when
    the environment turns the watch off."""
    if os.environ.get(WATCH_ENV, "1") == "0":
        log.info("parent watch off (%s=0): this process may outlive its server", WATCH_ENV)
        return None
    process = os.getpid() if process is None else process
    parent = os.getppid() if parent is None else parent
    return subprocess.Popen(["/bin/sh", "-c", WATCHER.format(process=process, parent=parent,
                                                             poll=poll_s)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, close_fds=True)
