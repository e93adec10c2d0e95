"""Fixtures for the end-to-end tests of `lockstep serve`.

Every server here is the real release binary (`target/release/lockstep`, or $LOCKSTEP_BIN) on
the embedded model (a tiny Qwen3-MoE with random weights and a byte-level tokenizer), started
on a free port and killed at the end of the session. Startup failures print the server's log;
set LOCKSTEP_E2E_KEEP_LOGS=1 to keep every server's log (in the temp dir) after the run.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import openai
import pytest
import requests

from e2e_util import SMALL_BODY_LIMIT

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = float(os.environ.get("LOCKSTEP_E2E_STARTUP_TIMEOUT", "120"))


def lockstep_bin() -> Path:
    path = Path(os.environ.get("LOCKSTEP_BIN", REPO / "target" / "release" / "lockstep"))
    if not path.is_file() or not os.access(path, os.X_OK):
        raise RuntimeError(
            f"lockstep binary not found at {path}: run `cargo build --release` "
            "first or point LOCKSTEP_BIN at one"
        )
    return path


def free_port() -> int:
    """A port nobody listens on right now (the OS picks it; a race is retried at start)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Every process started, so that none outlives the test run even if pytest dies abruptly.
_PROCS: list[subprocess.Popen] = []


@atexit.register
def _kill_leftovers() -> None:
    for p in _PROCS:
        if p.poll() is None:
            p.kill()


class Server:
    """One `lockstep serve` process."""

    def __init__(self, args: list[str], name: str):
        self.args = list(args)
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self._log = tempfile.NamedTemporaryFile(
            prefix=f"lockstep-e2e-{name}-", suffix=".log", delete=False
        )
        self.log_path = Path(self._log.name)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return "<no log>"

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> "Server":
        last_error = ""
        for _attempt in range(3):
            self.port = free_port()
            cmd = [
                str(lockstep_bin()),
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *self.args,
            ]
            self._log.write(f"$ {' '.join(cmd)}\n".encode())
            self._log.flush()
            env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_")}
            self.proc = subprocess.Popen(
                cmd,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=REPO,
            )
            _PROCS.append(self.proc)
            try:
                self._wait_healthy(timeout)
                return self
            except RuntimeError as e:
                last_error = str(e)
                self.kill()
                if "Address already in use" not in self.log_text():
                    break
        raise RuntimeError(
            f"server {self.name} did not become healthy: {last_error}\n"
            f"--- log {self.log_path} ---\n{self.log_text()[-8000:]}"
        )

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"process exited with code {self.proc.returncode}")
            try:
                r = requests.get(self.url + "/health", timeout=2)
                if r.status_code == 200:
                    return
                last = f"/health answered {r.status_code}"
            except requests.RequestException as e:
                last = f"/health: {type(e).__name__}"
            time.sleep(0.1)
        raise RuntimeError(f"timed out after {timeout:.0f}s ({last})")

    def terminate(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL if it lingers; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def close(self) -> None:
        self.terminate()
        self._log.close()
        if not os.environ.get("LOCKSTEP_E2E_KEEP_LOGS"):
            self.log_path.unlink(missing_ok=True)

    # Small conveniences used all over the tests.
    def get(self, path: str, **kw) -> requests.Response:
        kw.setdefault("timeout", 60)
        return requests.get(self.url + path, **kw)

    def post(self, path: str, **kw) -> requests.Response:
        kw.setdefault("timeout", 120)
        return requests.post(self.url + path, **kw)

    def openai(self, api_key: str = "unused", **kw) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120, **kw
        )


def _started(name: str, args: list[str]):
    srv = Server(args, name)
    try:
        srv.start()
        yield srv
    finally:
        srv.close()


@pytest.fixture(scope="session")
def server():
    """The shared server on default flags."""
    yield from _started("default", [])


@pytest.fixture(scope="session")
def keyed_server():
    """Generation guarded by k1, admin endpoints by k2."""
    yield from _started("keyed", ["--api-key", "k1", "--admin-api-key", "k2"])


@pytest.fixture(scope="session")
def routed_server():
    yield from _started("routed", ["--enable-return-routed-experts"])


@pytest.fixture(scope="session")
def small_body_server():
    """A server that refuses bodies over SMALL_BODY_LIMIT bytes."""
    yield from _started("small-body", ["--max-request-bytes", str(SMALL_BODY_LIMIT)])


@pytest.fixture
def fresh_server():
    """Starts a private server (for tests that stop it); killed afterwards in any case."""
    started: list[Server] = []

    def start(*args: str, name: str = "fresh") -> Server:
        srv = Server(list(args), name)
        started.append(srv)
        return srv.start()

    yield start
    for srv in started:
        srv.kill()
        srv.close()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return server.openai()
