"""Fixtures: a real kvedge daemon per test, started from the repository's
binary (KVEDGE_BIN, else target/debug/kvedge, else target/release/kvedge)."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import time
from typing import Iterator

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def kvedge_binary() -> str:
    explicit = os.environ.get("KVEDGE_BIN")
    if explicit:
        return explicit
    for profile in ("debug", "release"):
        candidate = REPO / "target" / profile / "kvedge"
        if candidate.exists():
            return str(candidate)
    raise RuntimeError("no kvedge binary: build it (cargo build --bin kvedge) or set KVEDGE_BIN")


class Daemon:
    def __init__(self, directory: pathlib.Path, process: subprocess.Popen) -> None:
        self.dir = directory
        self.process = process

    @property
    def control(self) -> str:
        return str(self.dir / "control.sock")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_daemon(directory: pathlib.Path, yaml: str) -> Daemon:
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "kvedge.yaml"
    config.write_text(yaml)
    process = subprocess.Popen(
        [kvedge_binary(), "run", "--config", str(config), "--runtime-dir", str(directory)],
        stderr=None if os.environ.get("KVEDGE_TEST_LOG") else subprocess.DEVNULL,
    )
    daemon = Daemon(directory, process)
    deadline = time.monotonic() + 10
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(str(directory / "query.sock"))
            return daemon
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                daemon.stop()
                raise RuntimeError("the daemon did not start")
            time.sleep(0.01)
        finally:
            s.close()


@pytest.fixture
def daemon(tmp_path: pathlib.Path) -> Iterator[Daemon]:
    d = start_daemon(tmp_path / "rt", "daemon:\n  heartbeat_timeout_ms: 600000\n")
    yield d
    d.stop()


def wait_for(condition, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)
