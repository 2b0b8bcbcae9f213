"""The channel between a notebook kernel and its live ranks: a Unix socket, a secret, pickle frames.

Owns who may talk to a pool and how messages travel. The kernel listens on a Unix socket in a
fresh temporary folder of mode 0700 (the socket file itself 0600), so only its own user can even
connect. Every connection must then present the pool's random secret within `AUTH_TIMEOUT_S`
(compared with `hmac.compare_digest`), from a process of the same user (`SO_PEERCRED`), or it is
closed. Only after that are frames read: an 8-byte length, then a pickle. Pickle runs code when
loaded, which is why no frame is ever read from a peer that has not proven it holds the secret.
The ranks get the socket path and the secret through torchrun's environment, never its argv
(argv is world-readable in /proc; the environment is not). Nothing here listens on a network.
Taught in notebook 01 (live ranks).
"""

from __future__ import annotations

import hmac
import os
import pickle
import secrets
import shutil
import socket
import struct
import tempfile
import time

SOCKET_VAR = "LABKIT_RANKS_SOCKET"
SECRET_VAR = "LABKIT_RANKS_SECRET"
DEVICE_VAR = "LABKIT_RANKS_DEVICE"  # the ranks' device ("auto", "cpu", "cuda")
PG_TIMEOUT_VAR = "LABKIT_RANKS_PG_TIMEOUT"  # the process group's timeout, seconds
AUTH_TIMEOUT_S = 2.0
_DIR_PREFIX = "labkit-ranks-"
_GREETING = b"labkit-ranks/1 "  # then the secret, 64 hex digits
_SECRET_LEN = 64
_OK = b"OK\n"
_HEADER = struct.Struct("!Q")


class ChannelError(ConnectionError):
    """The other side hung up, or could not prove it belongs to the pool."""


class ReprOnly:
    """Stands in for a value that cannot be pickled (a rank's module, an open file...): its repr only."""

    def __init__(self, text: str, type_name: str):
        self.text, self.type_name = text, type_name

    def __repr__(self) -> str:
        return self.text


def new_secret() -> str:
    return secrets.token_hex(_SECRET_LEN // 2)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes | None:
    """Exactly n bytes, or None at EOF. With a deadline, the WHOLE read must finish by then."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("deadline passed")
            sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def send_msg(sock: socket.socket, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def recv_msg(sock: socket.socket):
    """The next message, or None when the other side hung up. Use only on an authenticated socket."""
    head = _recv_exact(sock, _HEADER.size)
    if head is None:
        return None
    (n,) = _HEADER.unpack(head)
    data = _recv_exact(sock, n)
    if data is None:
        return None
    return pickle.loads(data)


def _repr(value) -> str:
    try:
        text = repr(value)
    except Exception as e:  # a broken __repr__
        text = f"<{type(value).__name__} (repr failed: {e})>"
    return text if len(text) <= 2000 else text[:2000] + "..."


def wrap(value) -> dict:
    """A rank's result for the trip to the kernel: its pickle (when it pickles) and its repr. The
    kernel unpickles it apart from the frame, so a value the kernel cannot load (a class defined
    in a cell, a module only the rank has) becomes its repr instead of breaking the channel."""
    try:
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        data = None
    return {"pickle": data, "repr": _repr(value) if data is None else None, "type": type(value).__name__}


def unwrap(box):
    if not isinstance(box, dict) or "pickle" not in box:
        return box
    if box["pickle"] is not None:
        try:
            return pickle.loads(box["pickle"])
        except Exception as e:
            return ReprOnly(f"<{box['type']} from the rank; the kernel cannot load it: {e}>", box["type"])
    return ReprOnly(box["repr"], box["type"])


def _peer_uid(conn: socket.socket) -> int | None:
    if not hasattr(socket, "SO_PEERCRED"):
        return None  # not Linux: the 0700 folder and the secret still hold
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def authenticate(conn: socket.socket, secret: str, timeout: float = AUTH_TIMEOUT_S) -> bool:
    """Server side: True when the peer is our user and sent the secret in time; the caller closes it otherwise."""
    try:
        uid = _peer_uid(conn)
        if uid is not None and uid != os.getuid():
            return False
        got = _recv_exact(conn, len(_GREETING) + _SECRET_LEN, time.monotonic() + timeout)
        if got is None or not hmac.compare_digest(got, _GREETING + secret.encode()):
            return False
        conn.settimeout(None)
        conn.sendall(_OK)
        return True
    except (OSError, ValueError):
        return False


def connect(path: str, secret: str, timeout: float = 10.0) -> socket.socket:
    """Client side (a rank): connect and prove we hold the secret; raises ChannelError when refused."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
        sock.sendall(_GREETING + secret.encode())
        if _recv_exact(sock, len(_OK), time.monotonic() + timeout) != _OK:
            raise ChannelError(f"the pool at {path} refused this connection (wrong secret?)")
    except (OSError, ChannelError):
        sock.close()
        raise
    sock.settimeout(None)
    return sock


def _socket_base() -> str:
    base = tempfile.gettempdir()
    if len(base) > 70 and os.path.isdir("/tmp"):  # a Unix socket path must stay under ~108 bytes
        base = "/tmp"
    return base


def sweep_stale(base: str | None = None) -> list[str]:
    """Remove the socket folders of pools whose kernel died hard (nothing listens there any more)."""
    base = base or _socket_base()
    removed = []
    try:
        names = [n for n in os.listdir(base) if n.startswith(_DIR_PREFIX)]
    except OSError:
        return removed
    for name in names:
        d = os.path.join(base, name)
        try:
            st = os.stat(d)
            if st.st_uid != os.getuid():
                continue
            path = os.path.join(d, "pool.sock")
            if not os.path.exists(path):
                stale = time.time() - st.st_mtime > 60  # not a pool that is binding right now
            else:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    try:
                        s.connect(path)
                        stale = False
                    except ConnectionRefusedError:
                        stale = True
        except OSError:
            continue
        if stale:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


class Listener:
    """The kernel's end: a Unix socket in a fresh 0700 folder, mode 0600, with a new random secret."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix=_DIR_PREFIX, dir=_socket_base())  # mkdtemp makes it 0700
        self.path = os.path.join(self.dir, "pool.sock")
        self.secret = new_secret()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind(self.path)
            os.chmod(self.path, 0o600)  # before listen(): nobody can connect before this
            self.sock.listen(16)
        except OSError:
            self.close()
            raise

    def env(self) -> dict:
        return {SOCKET_VAR: self.path, SECRET_VAR: self.secret}

    def close(self) -> None:
        try:
            shutdown(self.sock)  # wakes a thread blocked in accept()
            self.sock.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def shutdown(sock: socket.socket) -> None:
    """Wake any thread blocked on `sock` (close() alone does not), then close it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
