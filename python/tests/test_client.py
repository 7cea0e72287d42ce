"""The Python client and publisher against a real daemon."""

from __future__ import annotations

import asyncio
import pathlib

import pytest

import kvedge
from conftest import Daemon, start_daemon, wait_for

TOKENS = list(range(1, 257))  # 16 blocks of 16


def engine(d: Daemon, worker_id: int, model: str = "m") -> kvedge.Publisher:
    return kvedge.Publisher(
        d.control, worker_id, model, block_size=16, kv_blocks=(1024, 0, 0), endpoint=f"http://engine-{worker_id}"
    )


def test_a_publishers_events_change_what_select_answers(daemon: Daemon) -> None:
    a, b = engine(daemon, 1), engine(daemon, 2)
    with kvedge.Client(daemon.dir) as c:
        # B holds the prompt's first 12 blocks: it wins.
        assert b.stored(tokens=TOKENS[:192])
        wait_for(lambda: c.select("m", tokens=TOKENS, dry_run=True).device_blocks == 12, "B's blocks")
        s = c.select("m", tokens=TOKENS, dry_run=True)
        assert (s.worker_id, s.dp_rank, s.endpoint) == (2, 0, "http://engine-2")
        assert s.overlap_blocks == (12, 0, 0)
        # Hashes computed here are the ones the daemon computes.
        hashes = kvedge.hash_blocks(TOKENS, 16)
        assert len(hashes) == 16
        assert c.select("m", hashes=hashes, dry_run=True).worker_id == 2
        # B loses them and A gains all 16: A wins.
        assert b.removed(kvedge.hash_blocks(TOKENS[:192], 16))
        assert a.stored(hashes=hashes)
        wait_for(lambda: c.select("m", hashes=hashes, dry_run=True).worker_id == 1, "A's blocks")
        assert c.select("m", hashes=hashes, dry_run=True).device_blocks == 16
        # A clears its device tier: no overlap anywhere.
        assert a.cleared("device")
        wait_for(lambda: c.select("m", hashes=hashes, dry_run=True).device_blocks == 0, "the clear")
        assert a.load(active_requests=3, kv_used_blocks=10, kv_total_blocks=1024)
        assert a.heartbeat()
        assert a.poll() is None
        assert a.dropped == 0


def test_reservations_prefill_done_finish_and_their_errors(daemon: Daemon) -> None:
    _e = engine(daemon, 1)
    with kvedge.Client(daemon.dir) as c:
        wait_for(lambda: c.stats()["workers"] == 1, "the engine")
        s = c.select("m", tokens=TOKENS, session="conv-1", tenant="t", tags=["complexity-low"], headers={"x-team": "a"}, priority=2)
        assert s.request_id > 0
        assert c.stats()["reservations"] == 1
        c.prefill_done(s.request_id)
        c.finish(s.request_id)
        assert c.stats()["reservations"] == 0
        with pytest.raises(kvedge.UnknownRequest) as e:
            c.finish(s.request_id)
        assert (e.value.status, e.value.code) == ("unknown_request", 5)
        assert isinstance(e.value, kvedge.KvedgeError)
        with pytest.raises(kvedge.NoWorker) as e:
            c.select("no-such-model", tokens=TOKENS)
        assert e.value.code == 2
        # The JSON path reports the same status the same way.
        with pytest.raises(kvedge.NoWorker) as e:
            c.select("no-such-model", tokens=TOKENS, explain=True)
        assert (e.value.status, e.value.code) == ("no_worker", 2)
        assert type(e.value) is kvedge.errors.NoWorker


def test_error_statuses_map_to_one_hierarchy() -> None:
    # The codes come from the protocol's table in the native module; the
    # classes are declared once in kvedge.errors.
    too_large = kvedge.errors.status_error("frame_too_large", "too large")
    assert type(too_large) is kvedge.Refused
    assert (too_large.status, too_large.code, str(too_large)) == ("frame_too_large", 6, "too large")
    assert type(kvedge.errors.status_error("no_rule", "m")) is kvedge.Rejected
    odd = kvedge.errors.status_error("from_a_newer_daemon", "m")
    assert type(odd) is kvedge.Refused and odd.code is None
    assert kvedge.errors.unavailable("gone").status is None


def test_explain_names_the_policy_and_every_candidate(daemon: Daemon) -> None:
    a, _b = engine(daemon, 1), engine(daemon, 2)
    a.stored(tokens=TOKENS)
    with kvedge.Client(daemon.dir) as c:
        wait_for(lambda: c.select("m", tokens=TOKENS, dry_run=True).device_blocks == 16, "the blocks")
        s = c.select("m", tokens=TOKENS, dry_run=True, explain=True)
        assert s.worker_id == 1 and s.policy == "default" and s.rule is None
        assert s.explain is not None and s.explain["candidates"] == 2
        rows = {w["worker_id"]: w for w in s.explain["workers"]}
        assert rows[1]["overlap_blocks"]["device"] == 16
        assert rows[1]["ttft"]["total_ms"] < rows[2]["ttft"]["total_ms"]
        workers = c.workers()
        assert sorted(w["worker_id"] for w in workers) == [1, 2]


def test_query_channels_answer_like_the_socket(daemon: Daemon) -> None:
    a = engine(daemon, 1)
    a.stored(tokens=TOKENS)
    with kvedge.Client(daemon.dir) as c:
        wait_for(lambda: c.select("m", tokens=TOKENS, dry_run=True).device_blocks == 16, "the blocks")
        assert not c.rings_attached
        assert c.attach_rings()
        assert c.rings_attached
        for _ in range(100):
            s = c.select("m", tokens=TOKENS)
            assert (s.worker_id, s.device_blocks) == (1, 16)
            c.finish(s.request_id)
        assert c.stats()["reservations"] == 0


def test_bad_arguments_are_value_errors_and_change_nothing(daemon: Daemon) -> None:
    with kvedge.Client(daemon.dir) as c:
        with pytest.raises(ValueError):
            c.select("m")
        with pytest.raises(ValueError):
            c.select("m", tokens=TOKENS, hashes=[1])
        with pytest.raises(ValueError):
            c.select("m", tokens=TOKENS, role="chef")
        with pytest.raises(ValueError):
            c.select("m", tokens=TOKENS, tags=[f"t{i}" for i in range(100)])
        with pytest.raises(OverflowError):
            c.select("m", tokens=[-1])
        with pytest.raises(ValueError):
            kvedge.hash_blocks(TOKENS, 0)
        with pytest.raises(ValueError):
            kvedge.Publisher(daemon.control, 1, "m", block_size=0)
        # The connection still works.
        with pytest.raises(kvedge.NoWorker):
            c.select("m", tokens=TOKENS)


def test_a_dead_daemon_is_daemon_unavailable(tmp_path: pathlib.Path) -> None:
    with pytest.raises(kvedge.DaemonUnavailable) as e:
        kvedge.Client(tmp_path)
    assert e.value.code is None
    with pytest.raises(kvedge.DaemonUnavailable):
        kvedge.Publisher(str(tmp_path / "control.sock"), 1, "m")
    d = start_daemon(tmp_path / "rt", "daemon:\n  heartbeat_timeout_ms: 600000\n")
    c = kvedge.Client(d.dir, timeout=2.0)
    with pytest.raises(kvedge.NoWorker):
        c.select("m", tokens=TOKENS)
    d.stop()
    with pytest.raises(kvedge.DaemonUnavailable):
        c.select("m", tokens=TOKENS)
    with pytest.raises(kvedge.DaemonUnavailable):
        c.stats()
    c.close()
    with pytest.raises(kvedge.DaemonUnavailable):
        c.select("m", tokens=TOKENS)


def test_the_asyncio_client_keeps_100_concurrent_selects_apart(daemon: Daemon) -> None:
    # Ten models, each on its own worker: every answer must name the
    # worker of the model it asked for, and every request id is distinct.
    engines = [engine(daemon, w, model=f"m{w}") for w in range(1, 11)]
    with kvedge.Client(daemon.dir) as c:
        wait_for(lambda: c.stats()["workers"] == 10, "ten engines")

    async def main() -> None:
        async with kvedge.AsyncClient(daemon.dir, connections=8, rings=True) as ac:
            models = [f"m{1 + i % 10}" for i in range(100)]
            answers = await asyncio.gather(*(ac.select(m, tokens=TOKENS) for m in models))
            for m, s in zip(models, answers):
                assert s.worker_id == int(m[1:]), (m, s)
            assert len({s.request_id for s in answers}) == 100
            await asyncio.gather(*(ac.finish(s.request_id) for s in answers))
            assert (await ac.stats())["reservations"] == 0
            with pytest.raises(kvedge.NoWorker):
                await ac.select("nobody", tokens=TOKENS)

    asyncio.run(main())
    del engines


def test_a_waiting_call_releases_the_gil(daemon: Daemon) -> None:
    # With the daemon stopped, a select waits for its reply (until its
    # timeout); meanwhile other Python threads keep running.
    import os
    import signal
    import threading
    import time

    c = kvedge.Client(daemon.dir, timeout=1.0)
    os.kill(daemon.process.pid, signal.SIGSTOP)
    try:
        outcome = []

        def call() -> None:
            try:
                c.select("m", tokens=TOKENS)
            except kvedge.KvedgeError as e:
                outcome.append(e)

        t = threading.Thread(target=call)
        t.start()
        spins = 0
        stop = time.monotonic() + 0.5
        while time.monotonic() < stop:
            spins += 1
        t.join()
    finally:
        os.kill(daemon.process.pid, signal.SIGCONT)
    assert spins > 100_000, spins
    assert len(outcome) == 1 and isinstance(outcome[0], kvedge.DaemonUnavailable), outcome


def test_block_hashes_are_read_natively_and_behave_as_a_sequence(daemon: Daemon) -> None:
    a = engine(daemon, 1)
    a.stored(tokens=TOKENS)
    bh = kvedge.block_hashes(TOKENS, 16)
    assert isinstance(bh, kvedge.BlockHashes)
    assert len(bh) == 16 and bh.to_list() == kvedge.hash_blocks(TOKENS, 16)
    assert bh[0] == bh.to_list()[0] and bh[-1] == bh.to_list()[-1]
    with pytest.raises(IndexError):
        bh[16]
    assert kvedge.BlockHashes(bh.to_list()).to_list() == bh.to_list()
    with kvedge.Client(daemon.dir) as c:
        wait_for(lambda: c.select("m", hashes=bh, dry_run=True).device_blocks == 16, "the blocks")
        c.attach_rings()
        assert c.select("m", hashes=bh, dry_run=True).worker_id == 1
        # The JSON path takes them too.
        assert c.select("m", hashes=bh, dry_run=True, explain=True).device_blocks == 16
        with pytest.raises(TypeError):
            c.select("m", hashes=bh, explain=True, colour="blue")


def test_a_rules_provider_pick_names_the_provider(tmp_path: pathlib.Path) -> None:
    d = start_daemon(
        tmp_path / "rt",
        "daemon:\n  heartbeat_timeout_ms: 600000\n"
        "policy:\n  rules:\n"
        "    - name: premium\n      matches:\n        - { header.x-tier: premium }\n"
        "      route:\n        consider:\n          - providers: {}\n"
        "        select:\n          - { type: Provider, order: [cloud] }\n"
        "    - name: everyone\n      route:\n        select:\n          - { type: Local, minimize: PredictedTTFT }\n"
        "providers:\n  - { name: cloud, models: [m], endpoint: \"https://cloud.example\" }\n",
    )
    try:
        local = engine(d, 1)
        with kvedge.Client(d.dir) as c:
            wait_for(lambda: c.select("m", tokens=TOKENS, dry_run=True).worker_id == 1, "the engine")
            s = c.select("m", tokens=TOKENS, headers={"x-tier": "premium"}, dry_run=True)
            assert (s.provider, s.endpoint, s.worker_id) == ("cloud", "https://cloud.example", None)
            assert c.select("m", tokens=TOKENS, dry_run=True).provider is None
        del local
    finally:
        d.stop()


def test_a_ticking_engine_registers_again_after_the_daemon_restarts(tmp_path: pathlib.Path) -> None:
    rt = tmp_path / "rt"
    yaml = "daemon:\n  heartbeat_timeout_ms: 600000\n"
    first = start_daemon(rt, yaml)
    p = engine(first, 7)
    assert p.stored(tokens=TOKENS)
    assert p.tick() is None and p.registered
    first.stop()
    # The daemon is gone: the session says so, and nothing is due.
    wait_for(lambda: p.tick() is None and not p.registered, "the closed session")
    second = start_daemon(rt, yaml)
    try:
        # Ticking registers again (backing off meanwhile), then asks for
        # every block held, once.
        actions = []
        wait_for(lambda: actions.append(p.tick()) or p.registered, "a registration again", timeout=10)
        assert ("republish", None) in actions
        assert p.stored(tokens=TOKENS)
        assert p.tick() is None
        with kvedge.Client(rt) as c:
            wait_for(lambda: c.select("m", tokens=TOKENS, dry_run=True).device_blocks == 16, "the republished blocks")
            assert c.select("m", tokens=TOKENS, dry_run=True).worker_id == 7
    finally:
        second.stop()


def test_an_explicit_target_and_session_metadata_reach_the_daemon(daemon: Daemon) -> None:
    a, b = engine(daemon, 1), engine(daemon, 2)
    with kvedge.Client(daemon.dir) as c:
        wait_for(lambda: c.stats()["workers"] == 2, "the engines")
        # B holds the prompt, so a policy picks B; a target picks A anyway,
        # over either protocol, and a target that is not registered is no
        # worker.
        assert b.stored(tokens=TOKENS)
        wait_for(lambda: c.select("m", tokens=TOKENS, dry_run=True).worker_id == 2, "B's blocks")
        for explain in (False, True):
            s = c.select("m", tokens=TOKENS, dry_run=True, target=(1, 0), explain=explain)
            assert (s.worker_id, s.device_blocks) == (1, 0)
            with pytest.raises(kvedge.NoWorker):
                c.select("m", tokens=TOKENS, dry_run=True, target=(9, 0), explain=explain)
            s = c.select(
                "m", tokens=TOKENS, dry_run=True, session="child", parent_session="parent",
                trigger="tool", final_turn=True, explain=explain,
            )
            assert s.worker_id == 2
            # Session metadata without a session, or an unknown trigger, is
            # refused and changes nothing.
            with pytest.raises((ValueError, kvedge.BadRequest)):
                c.select("m", tokens=TOKENS, dry_run=True, trigger="tool", explain=explain)
            with pytest.raises((ValueError, kvedge.BadRequest)):
                c.select("m", tokens=TOKENS, dry_run=True, session="s", trigger="bot", explain=explain)
        assert c.stats()["reservations"] == 0
        # A dispatch that failed: aborted, and the session's binding with it.
        s = c.select("m", tokens=TOKENS, session="pinned", target=(1, 0))
        assert c.select("m", tokens=TOKENS, session="pinned", dry_run=True).worker_id == 1
        c.abort(s.request_id)
        assert c.select("m", tokens=TOKENS, session="pinned", dry_run=True).worker_id == 2
        with pytest.raises(kvedge.UnknownRequest):
            c.abort(s.request_id)
        assert c.stats()["reservations"] == 0
        del a


def test_a_publishers_labels_reach_the_daemon(daemon: Daemon) -> None:
    p = kvedge.Publisher(daemon.control, 5, "m", endpoint="http://five", labels={"backend": "fast", "gpu": "h100"})
    with kvedge.Client(daemon.dir) as c:
        wait_for(lambda: c.stats()["workers"] == 1, "the engine")
        (row,) = c.workers()
        assert row["labels"] == ["backend=fast", "gpu=h100"]
        with pytest.raises(ValueError):
            kvedge.Publisher(daemon.control, 6, "m", labels={"a=b": "c"})
        assert c.stats()["workers"] == 1
    del p


def test_taints_keep_requests_that_do_not_tolerate_them_away(daemon: Daemon) -> None:
    p = kvedge.Publisher(daemon.control, 7, "m", endpoint="http://seven", taints=["draining:NoSchedule"])
    with kvedge.Client(daemon.dir) as c:
        wait_for(lambda: c.stats()["workers"] == 1, "the engine")
        with pytest.raises(kvedge.NoWorker):
            c.select("m", tokens=TOKENS, dry_run=True)
        for explain in (False, True):
            s = c.select("m", tokens=TOKENS, dry_run=True, tolerations=["draining"], explain=explain)
            assert s.worker_id == 7
    del p
