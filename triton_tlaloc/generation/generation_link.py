"""The local link between a generate model and the sequence model whose process runs its
generations (docs/design.md#generation-inside-the-engine).

Both are Python-backend models of one tritonserver, each in its own process (a stub), both
children of the server's process. The sequence model listens on a Unix socket, and the generate
model connects to it, at an address both derive from the server's process id and the sequence
model's name, in a directory only this user may enter (0700, owned by the user). The connection
is authenticated by a random key that the listener writes next to the socket (0600): only a
process of the same user can read it, and the handshake (multiprocessing.connection's HMAC
challenge) refuses any peer without it. Frames are JSON, never pickles, so even an authenticated
peer sends data, not code.

Frames from the generate model: a list of commands, `["start", id, {prompt, sampling, salt}]`
or `["cancel", id]`. Frames from the sequence model: a list of events, one per generation and
step, `[id, token, finish_reason, code, message]` (token -1: none; finish_reason null until the
last).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import stat
import tempfile
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

KEY_BYTES = 32


class LinkError(Exception):
    """The link cannot be opened (named: the directory is not private, no listener)."""


def link_directory() -> Path:
    """The user's private directory for links: created 0700, refused when another user owns
    it or others may enter it (a socket there could be someone else's)."""
    d = Path(tempfile.gettempdir()) / f"tlaloc-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    st = d.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise LinkError(f"{d}: not a directory private to this user (mode "
                        f"{oct(st.st_mode & 0o777)}, owner {st.st_uid}): local generation off")
    return d


def instance_link(sequence_model: str, instance: int) -> str:
    """The name instance `instance` of a sequence model listens under: the model's own name for
    instance 0 (the only one of most models), "NAME#i" for the other data-parallel instances,
    each a process with its own batcher."""
    return sequence_model if instance == 0 else f"{sequence_model}#{instance}"


def link_paths(sequence_model: str, server_pid: int | None = None) -> tuple[Path, Path]:
    """The socket and key file of `sequence_model` in the server whose process is
    `server_pid` (by default this process's parent: the stubs' server)."""
    pid = os.getppid() if server_pid is None else server_pid
    name = hashlib.sha256(sequence_model.encode()).hexdigest()[:16]  # a socket path is short
    d = link_directory()
    return d / f"{pid}-{name}.sock", d / f"{pid}-{name}.key"


def listen(sequence_model: str, server_pid: int | None = None) -> tuple[Listener, Path, Path]:
    """The sequence model's listener. Refuses (LinkError) when another instance of the model
    in the same server listens already."""
    sock, key_file = link_paths(sequence_model, server_pid)
    if sock.exists():
        if knock(sock):
            raise LinkError(f"{sock} exists: another instance of {sequence_model} in this "
                            f"server runs the local generations")
        # Left by a server that was killed (its process id is this one's again): removed.
        sock.unlink(missing_ok=True)
    key = secrets.token_bytes(KEY_BYTES)
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return Listener(str(sock), family="AF_UNIX", authkey=key), sock, key_file


def knock(sock: Path) -> bool:
    """Connects to the socket and hangs up: whether something listens there (a listener's
    blocked accept() returns, which is also how one is woken to stop)."""
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(sock))
        except OSError:  # refused: nothing listens there any more
            return False
    return True


def connect(sequence_model: str, server_pid: int | None = None) -> Connection:
    """The generate model's end. LinkError when the sequence model does not listen (yet)."""
    sock, key_file = link_paths(sequence_model, server_pid)
    try:
        key = key_file.read_bytes()
        return Client(str(sock), family="AF_UNIX", authkey=key)
    except (OSError, EOFError) as e:
        raise LinkError(f"{sequence_model}: no local generation link at {sock}: {e}") from None


def hang_up(conn: Connection) -> None:
    """Shuts the connection's socket down both ways: a thread blocked reading it gets the end
    of the stream (closing it under that thread could hand its descriptor to another file).
    The reading thread closes it."""
    try:
        with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed already
        pass


def send_frame(conn: Connection, items: list) -> None:
    conn.send_bytes(json.dumps(items, separators=(",", ":")).encode())


def receive_frame(conn: Connection) -> list:
    items = json.loads(conn.recv_bytes())
    if not isinstance(items, list):
        raise ValueError("a link frame must be a JSON list")
    return items
