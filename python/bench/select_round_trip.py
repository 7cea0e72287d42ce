"""Select round trip from Python beside the same from C, in one run.

Starts a real daemon (the repository's release binary), registers an
engine holding 128 blocks, then measures dry-run selects of those 128
hashes: through the Python package and through libkvedge (a small C
program, python/bench/c_select_loop.c), over query.sock and over a query
channel, alternating the two in three rounds so drift hits both alike.
Prints the median and mean round trip of each, and the Python/C ratios.

This is not a criterion bench (criterion measures Rust); it times each call
with the monotonic clock, after a warm-up, like criterion's samples.

    cargo build --release --bin kvedge -p kvedge-c
    python python/bench/select_round_trip.py [N]
"""

from __future__ import annotations

import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import kvedge

REPO = pathlib.Path(__file__).resolve().parents[2]
RELEASE = REPO / "target" / "release"


def build_c(work: pathlib.Path) -> pathlib.Path:
    exe = work / "c_select_loop"
    subprocess.run(
        [
            os.environ.get("CC", "cc"), "-O2", "-o", str(exe),
            str(REPO / "python" / "bench" / "c_select_loop.c"),
            f"-I{REPO / 'client-c' / 'include'}", f"-L{RELEASE}", "-lkvedge",
            f"-Wl,-rpath,{RELEASE}",
        ],
        check=True,
    )
    return exe


def python_loop(query_dir: pathlib.Path, rings: bool, n: int, native: bool) -> tuple[float, float]:
    # As the C caller passes its array: the hashes held natively
    # (BlockHashes), or (native=False) a Python list converted per call.
    hashes = kvedge.BlockHashes(range(1, 129)) if native else list(range(1, 129))
    with kvedge.Client(query_dir) as c:
        if rings:
            assert c.attach_rings()
        for _ in range(n // 10 + 100):
            c.select("m", hashes=hashes, dry_run=True)
        samples = []
        for _ in range(n):
            t = time.perf_counter_ns()
            c.select("m", hashes=hashes, dry_run=True)
            samples.append(time.perf_counter_ns() - t)
    return statistics.median(samples), statistics.fmean(samples)


def c_loop(exe: pathlib.Path, query_dir: pathlib.Path, rings: bool, n: int) -> tuple[float, float]:
    out = subprocess.run(
        [str(exe), str(query_dir / "query.sock"), "m", str(n), "1" if rings else "0"],
        check=True, capture_output=True, text=True,
    ).stdout.split()
    return float(out[0]), float(out[1])


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    work = pathlib.Path(tempfile.mkdtemp(prefix="kvedge-pybench-"))
    rt = work / "rt"
    rt.mkdir()
    (rt / "kvedge.yaml").write_text("daemon:\n  heartbeat_timeout_ms: 600000\n")
    daemon = subprocess.Popen(
        [str(RELEASE / "kvedge"), "run", "--config", str(rt / "kvedge.yaml"), "--runtime-dir", str(rt)],
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not (rt / "query.sock").exists():
            if time.monotonic() > deadline:
                raise SystemExit("the daemon did not start")
            time.sleep(0.01)
        time.sleep(0.1)
        engine = kvedge.Publisher(str(rt / "control.sock"), 1, "m", block_size=16)
        engine.stored(hashes=list(range(1, 129)))
        with kvedge.Client(rt) as c:
            deadline = time.monotonic() + 5
            while c.select("m", hashes=list(range(1, 129)), dry_run=True).device_blocks != 128:
                if time.monotonic() > deadline:
                    raise SystemExit("the engine's blocks never arrived")
                time.sleep(0.01)
        exe = build_c(work)
        rows = []
        for rings in (False, True):
            for round_ in (1, 2, 3):
                py = python_loop(rt, rings, n, native=True)
                c = c_loop(exe, rt, rings, n)
                py_list = python_loop(rt, rings, n, native=False)
                rows.append((rings, round_, py, c, py_list))
        print(f"{n} dry-run selects of 128 hashes per measurement; median / mean ns")
        print("| path | round | Python, BlockHashes | C | Python / C (median) | Python, a list of ints |")
        print("|---|---|---|---|---|---|")
        for rings, round_, py, c, py_list in rows:
            path = "query channel" if rings else "socket"
            print(
                f"| {path} | {round_} | {py[0]:.0f} / {py[1]:.0f} | {c[0]:.0f} / {c[1]:.0f} "
                f"| {py[0] / c[0]:.2f} | {py_list[0]:.0f} / {py_list[1]:.0f} |"
            )
        del engine
    finally:
        daemon.terminate()
        daemon.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
