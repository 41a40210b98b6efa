"""The two-rank service (`--ranks 2`, gloo on the CPU): tensor-parallel
agreement with the one-rank model, real processes, and real faults across
the ranks (root: network namespaces, BPF uprobes).

- the TP shards compute the one-rank model's logits (float tolerance) and
  the same greedy tokens; the two-rank service answers what the one-rank
  service answers for the same seed;
- rank 1 killed: rank 0 stays up, its breaker opens, /health says why;
- a partition between the ranks' network namespaces (netchaos, gloo over
  the veth) degrades the answers, and the service recovers after it heals
  (the recovery time is measured);
- a 5 ms stall of rank 1 in gloo's allreduce on 5 % of calls raises the
  service's p99 (open-loop load).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from procio import finish, start_ready
from service_proc import ServiceProc

from pyctl.service.model import build_model
from pyctl.service.tp import shard

KW = dict(vocab_size=500, d_model=64, n_heads=4, n_layers=2, max_context=64, seed=7)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_tp_shards_compute_the_one_rank_model() -> None:
    """Two ranks as two threads over one HashStore: the sum of the shards'
    work is the full model's, up to float addition order."""
    full = build_model(**KW)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, KW["vocab_size"], (3, 11), generator=g)
    valid = torch.ones(3, 11, dtype=torch.bool)
    valid[0, :4] = False  # a left-padded row
    with torch.inference_mode():
        want = full(ids, valid)
    store = dist.HashStore()
    # One intra-op thread, as the service runs (--torch-threads 1): two
    # ranks sharing one pool could split a matmul differently.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict[int, torch.Tensor] = {}
    errs: list[BaseException] = []
    # Built here, one after the other: build_model seeds torch's global RNG,
    # which two threads must not share.
    fulls = [build_model(**KW) for _ in (0, 1)]

    def rank(r: int) -> None:
        try:
            pg = dist.ProcessGroupGloo(store, r, 2, datetime.timedelta(seconds=30))

            def all_reduce(t: torch.Tensor) -> torch.Tensor:
                pg.allreduce([t]).wait()
                return t

            m = shard(fulls[r], r, 2, all_reduce)
            with torch.inference_mode():
                out[r] = m(ids, valid)
        except BaseException as e:  # reported below
            errs.append(e)

    ts = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    torch.set_num_threads(threads)
    assert not errs, errs
    # Both ranks hold the same (all-reduced) logits: bit for bit.
    assert torch.equal(out[0], out[1])
    diff = (out[0] - want).abs().max().item()
    print(f"TP vs one rank: max |logit difference| {diff:.2e}")
    assert diff < 1e-4
    assert torch.equal(out[0].argmax(-1), want.argmax(-1))


@pytest.mark.parametrize(
    "name", ["gloo-allreduce-stall", "nccl-allreduce-stall", "nccl-allreduce-error"]
)
def test_two_rank_experiment_files_validate(name: str) -> None:
    """The class-3 experiment files (issue 16) load through the experiment
    format's own checks (running them: gloo here, nccl on two GPUs)."""
    from pyctl.experiment import load as files

    e = files.load(name)
    assert "--ranks" in e.target.command  # the service shortcut, spelled out as its command
    assert e.steps and all(s.specs for s in e.steps)


PROMPTS = ["hello world", "the quick brown fox", "a", "tensor parallel decoding", "zz top"]


def _answers(s: ServiceProc) -> list[str]:
    out = []
    for p in PROMPTS:
        st, body = s.complete(p, 8)
        assert st == 200 and body["degraded"] is False, body
        out.append(body["choices"][0]["text"])
    # Sampling too: the per-request seed follows the request count.
    st, body = s.complete("sampled", 8, temperature=0.9)
    assert st == 200, body
    out.append(body["choices"][0]["text"])
    # A batch of several (left-padded) rows at once.
    got: dict[int, str] = {}

    def one(i: int) -> None:
        st, body = s.complete(PROMPTS[i], 6)
        got[i] = body["choices"][0]["text"] if st == 200 else f"status {st}"

    ts = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return out + [got[i] for i in range(4)]


def _ready(path: Path) -> dict:
    return json.loads(path.read_text())


def test_two_ranks_answer_what_one_rank_answers(tmp_path: Path) -> None:
    one = ServiceProc("--batch-wait", "20ms")
    try:
        want = _answers(one)
    finally:
        assert one.close() == 0, one.stderr()
    rf = tmp_path / "ready.json"
    two = ServiceProc("--ranks", "2", "--batch-wait", "20ms", "--ready-file", str(rf))
    try:
        info = _ready(rf)
        assert [r["rank"] for r in info["ranks"]] == [0, 1]
        r0, r1 = info["ranks"]
        assert r0["pid"] == two.pid and r1["pid"] != two.pid and r1["worker_tid"]
        assert {"url", "pid", "worker_tid", "device"} <= set(info)
        got = _answers(two)
        assert got == want
        # Both ranks made the collectives: rank 1's own /metrics says so.
        import urllib.request

        with urllib.request.urlopen(r1["metrics_url"], timeout=10) as resp:
            m1 = resp.read().decode()
        m0 = two.metrics()
        for m in (m0, m1):
            line = next(
                ln
                for ln in m.splitlines()
                if ln.startswith('gf_service_dist_collectives_total{op="all_reduce"}')
            )
            assert float(line.split()[-1]) > 0, line
        st, h = two.health()
        assert h["status"] == "ok" and h["dist"]["group"] == "up", h
    finally:
        assert two.close() == 0, two.stderr()
    # Stopping rank 0 stopped (and reaped) rank 1.
    assert not _pid_alive(r1["pid"]), "rank 1 outlived rank 0"
    assert not rf.exists()


def _listen_addr(pid: int, port: int) -> str:
    """The local address (hex, as /proc/net/tcp has it) pid listens on at port."""
    want = f":{port:04X}"
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        local, _remote, state = line.split()[1:4]
        if state == "0A" and local.endswith(want):  # TCP_LISTEN
            return local.split(":")[0]
    raise AssertionError(f"pid {pid} does not listen on port {port}")


def test_rank1_metrics_listener_is_bounded_like_rank0s(tmp_path: Path) -> None:
    """Issue 25 items 6 and 14 for rank 1's /metrics (a ThreadingHTTPServer
    with a thread per connection and no timeouts before): bound to
    loopback and the line names what is bound; 60 half-sent requests hold
    at most --max-connections threads, the rest get 503 at once and the
    held ones 408 within --header-timeout; a whole request is answered
    afterwards. Before: 60 threads, and the half-sent ones hung."""
    import socket
    import time
    import urllib.request

    rf = tmp_path / "ready.json"
    s = ServiceProc("--ranks", "2", "--batch-wait", "0", "--ready-file", str(rf),
                    "--max-connections", "8", "--header-timeout", "3s")  # fmt: skip
    socks: list[socket.socket] = []
    try:
        r1 = _ready(rf)["ranks"][1]
        url = r1["metrics_url"]
        host, port = url.split("/")[2].rsplit(":", 1)
        assert host == "127.0.0.1" and _listen_addr(r1["pid"], int(port)) == "0100007F", url
        wait_until = time.monotonic() + 30
        while f"metrics on {url}" not in s.stderr():
            assert time.monotonic() < wait_until, s.stderr()  # the line names what is bound
            time.sleep(0.1)

        def threads() -> int:
            return len(os.listdir(f"/proc/{r1['pid']}/task"))

        def status(c: socket.socket) -> int:
            # One deadline for all (the old listener answered none of them).
            c.settimeout(max(0.1, t0 + 20 - time.monotonic()))
            try:
                got = c.recv(65536)
            except (ConnectionResetError, TimeoutError):
                got = b""
            return int(got.split()[1]) if got.startswith(b"HTTP/1.1 ") else 0

        base = threads()
        t0 = time.monotonic()
        for _ in range(60):
            c = socket.create_connection((host, int(port)), timeout=10)
            c.sendall(b"GET /metrics HTTP/1.1\r\n")  # and nothing more
            socks.append(c)
        # Accepted in order: the first 8 hold a thread each, the others are
        # answered at once; once they are, every connection was accepted.
        shed = [status(c) for c in socks[8:]]
        peak = threads()
        held = [status(c) for c in socks[:8]]
        took = time.monotonic() - t0
        assert peak <= base + 8, (base, peak)
        assert shed.count(503) >= len(shed) - 2 and held.count(408) >= 6, (shed, held)
        assert took < 3 + 10, took  # the header timeout, not forever
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert resp.status == 200 and b"gf_service_dist" in resp.read()
    finally:
        for c in socks:
            c.close()
        assert s.close() == 0, s.stderr()


def test_rank1_killed_opens_the_breaker_and_rank0_stays_up(tmp_path: Path) -> None:
    rf = tmp_path / "ready.json"
    s = ServiceProc(
        "--ranks", "2", "--batch-wait", "0", "--breaker-cooldown", "500ms",
        "--dist-timeout", "3s", "--ready-file", str(rf),
    )  # fmt: skip
    try:
        r1 = _ready(rf)["ranks"][1]["pid"]
        assert s.complete("before", 4)[1]["degraded"] is False
        os.kill(r1, signal.SIGKILL)
        answers = [s.complete(f"after {i}", 4) for i in range(6)]
        assert all(st == 200 for st, _ in answers), answers
        assert all(b["degraded"] for _, b in answers[2:]), answers
        st, h = s.health()
        assert st == 200 and h["status"] == "degraded", h
        assert h["breaker"]["state"] in ("open", "half-open") and h["breaker"]["trips"] >= 1, h
        assert h["dist"]["group"] == "down" and h["dist"]["peer"]["exited"] == -9, h
        assert any("rank 1" in r for r in h["reasons"]), h
        assert "DIST_ERROR" in (h["breaker"]["last_error"] or ""), h
        sm = s.metric_samples()

        # The breaker's three errors: a dead peer fails a collective at once
        # (DIST_ERROR) or, on a loaded machine, after --dist-timeout
        # (DIST_TIMEOUT: seen once with three test workers on two cores).
        dist = sum(
            v
            for (n, lab), v in sm.items()
            if n == "gf_service_errors_total"
            and dict(lab).get("kind") == "device"
            and dict(lab).get("code") in ("DIST_ERROR", "DIST_TIMEOUT")
        )
        assert dist >= 3, sm
        assert s.proc.poll() is None
    finally:
        assert s.close() == 0, s.stderr()


# ---- root: real faults across the ranks -------------------------------------------
# gloo::allreduce(gloo::AllreduceOptions const&): the collective itself, run
# on ProcessGroupGloo's worker threads (c10d::ProcessGroupGloo::allreduce,
# on the gf-worker thread, only enqueues it).
GLOO_ALLREDUCE = "_ZN4gloo9allreduceERKNS_16AllreduceOptionsE"


def _libtorch_cpu() -> str:
    return str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")


class NsServiceProc(ServiceProc):
    """A ServiceProc inside network namespace `ns`: its HTTP requests are
    made from a thread that entered it."""

    def __init__(self, ns: str, *args: str) -> None:
        self.ns = ns
        super().__init__(*args, prefix=("ip", "netns", "exec", ns))

    def request(self, *a, **kw):  # type: ignore[no-untyped-def]
        from pyctl import netchaos

        return netchaos.run_in_netns(self.ns, lambda: ServiceProc.request(self, *a, **kw))


@pytest.mark.root
@pytest.mark.parametrize("partition_s", [5.0, 12.0])
def test_partition_between_the_ranks_namespaces_degrades_then_recovers(
    tmp_path: Path, partition_s: float
) -> None:
    if os.geteuid() != 0:
        pytest.skip("requires root (netns, tc, bpf)")
    pytest.importorskip("pyroute2")
    import subprocess
    import sys
    import time

    from pyctl import netchaos
    from pyctl.experiment.loadgen import OpenLoopLoad, window_stats

    port = 29400
    dist_args = ("--ranks", "2", "--dist-timeout", "2s", "--master-addr")
    with netchaos.Link() as link:
        log1 = open(tmp_path / "rank1.log", "w")
        r1 = subprocess.Popen(
            ["ip", "netns", "exec", link.b.ns, sys.executable, "-m", "pyctl.service",
             *dist_args, link.a.addr, "--master-port", str(port), "--rank", "1",
             "--dist-iface", link.b.ifname],
            stdin=subprocess.DEVNULL, stdout=log1, stderr=log1,
        )  # fmt: skip
        s = None
        load = None
        try:
            s = NsServiceProc(
                link.a.ns, *dist_args, link.a.addr, "--master-port", str(port),
                "--no-spawn-peer", "--dist-iface", link.a.ifname, "--batch-wait", "0",
                "--breaker-cooldown", "500ms",
            )  # fmt: skip
            assert s.complete("before", 4)[1]["degraded"] is False
            load = OpenLoopLoad(s.url, rate=20, max_tokens=4, timeout=10)
            netchaos.run_in_netns(link.a.ns, load.start)  # its threads live in namespace a
            time.sleep(3)  # the baseline window (load runs meanwhile)
            t_part = time.time()
            link.partition()
            health = []
            while time.time() < t_part + partition_s:
                health.append(s.health()[1])
                time.sleep(0.25)  # a probe's period, not a synchronization
            link.heal()
            t_heal = time.time()
            first_ok = None
            while time.time() < t_heal + 30:
                st, body = s.complete("after", 4)
                if st == 200 and body["degraded"] is False:
                    first_ok = time.time()
                    break
            time.sleep(2)  # a window of load after the recovery
            load.stop()
            assert first_ok is not None, s.stderr()
            recovery = first_ok - t_heal
            samples = load.samples()
            base = window_stats(samples, t_part - 3, t_part)
            during = window_stats(samples, t_part, t_heal)
            after = window_stats(samples, first_ok, first_ok + 2)
            states = {h["breaker"]["state"] for h in health}
            groups = {h["dist"]["group"] for h in health}
            st, h = s.health()
            print(
                f"partition {partition_s:g} s: baseline p50/p99 {base.p50 * 1e3:.1f}/"
                f"{base.p99 * 1e3:.1f} ms; during: p99 {during.p99 * 1e3:.0f} ms, "
                f"error rate {during.error_rate:.2f}; breaker {sorted(states)}; "
                f"recovered {recovery * 1e3:.0f} ms after the heal "
                f"(generation {h['dist']['generation']}); after: {after.count} requests, "
                f"p99 {after.p99 * 1e3:.1f} ms"
            )
            assert "open" in states and "down" in groups, health
            # The fallback answered while the ranks could not talk: no errors.
            assert during.error_rate == 0, during
            assert h["status"] == "ok" and h["dist"]["group"] == "up", h
            assert h["dist"]["generation"] >= 2
            from service_proc import sample

            sm = s.metric_samples()
            # The batch caught in the partition timed out; the ones after it failed fast.
            assert sample(sm, "gf_service_errors_total", kind="device", code="DIST_TIMEOUT") >= 1
            assert recovery < 15
        finally:
            if load is not None:
                load.stop()
            if s is not None:
                assert s.close() == 0, s.stderr()
            try:
                r1.wait(15)  # rank 0 told it to stop
            except subprocess.TimeoutExpired:
                r1.kill()
                r1.wait()
                raise
            finally:
                log1.close()
        assert r1.returncode == 0, (tmp_path / "rank1.log").read_text()


@pytest.mark.root
def test_stall_in_gloo_allreduce_on_rank1_makes_the_service_slower(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("requires root (BPF uprobes)")
    import sys
    import time

    from pyctl.experiment.loadgen import OpenLoopLoad, window_stats
    from pyctl.experiment.stats import judge

    rf = tmp_path / "ready.json"
    s = ServiceProc("--ranks", "2", "--batch-wait", "0", "--ready-file", str(rf))
    ctl = None
    load = OpenLoopLoad(s.url, rate=20, max_tokens=4, timeout=10)
    try:
        r1 = _ready(rf)["ranks"][1]["pid"]
        load.start()
        time.sleep(8)  # baseline window
        t_base = time.time()
        ctl, _ = start_ready(
            [sys.executable, "-m", "pyctl", "inject", "--pid", str(r1), "--db",
             str(tmp_path / "gf.db"), "-q", "--lib", _libtorch_cpu(), "--fn", GLOO_ALLREDUCE,
             "--action", "stall", "--stall", "20ms", "--prob", "15%", "--duration", "60s"],
        )  # fmt: skip
        t_armed = time.time()
        time.sleep(10)  # the fault window
        t_end = time.time()
        ctl.send_signal(signal.SIGINT)
        _out, err = finish(ctl, 60)
        load.stop()
        samples = load.samples()
        base = window_stats(samples, t_base - 8, t_base)
        stall = window_stats(samples, t_armed, t_end)
        from pyctl.api import open_evidence

        with open_evidence(tmp_path / "gf.db") as ev:
            fires = len(ev.faults())
        print(
            f"gloo::allreduce 20 ms stall on 15 %: p50/p99 {base.p50 * 1e3:.1f}/"
            f"{base.p99 * 1e3:.1f} ms -> {stall.p50 * 1e3:.1f}/{stall.p99 * 1e3:.1f} ms "
            f"({base.count}/{stall.count} requests); {fires} fires"
        )
        assert base.error_rate == 0 and stall.error_rate == 0
        # A window without fires is a different failure than a judge that
        # finds nothing; say which (CI's run once printed neither).
        assert fires > 0, err
        # The experiment judge, not one p99 of 160 requests against another
        # (a single slow baseline request once made it 104 ms, above the
        # stalled window's 64 ms, though p50 and p95 rose by 8 and 13 ms).
        # 20 ms on 15 %, not the experiment's 5 ms on 5 %: rank 1 calls
        # allreduce ~40-50 times a second under this load (batches, not
        # requests), so 20 ms on 5 % held it ~0.5 s in 10 s, which a CI run
        # whose baseline p50 was already 195 ms did not show (p = 0.89); on
        # 25 % (~2.5 s held) a loaded machine's p99 reached 4.7 s, near the
        # load's 10 s timeout. 15 % holds it ~1.5 s.
        j = judge(
            [x.latency for x in load.samples(t_base - 8, t_base)],
            [x.latency for x in load.samples(t_armed, t_end)],
            alpha=0.01,
        )
        print(j.reason)
        assert j.worse, j.reason
    finally:
        load.stop()
        if ctl is not None and ctl.poll() is None:
            ctl.send_signal(signal.SIGINT)
            finish(ctl, 60)
        assert s.close() == 0, s.stderr()
