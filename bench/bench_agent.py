"""The node agent's costs on this machine: arm and disarm round trips
through an agent process (`gpufault agent serve`) over its Unix socket and
over TLS (bearer token, loopback), fires streamed per second through it
(every gf_empty call failed, no stacks), lease expiry to the last fire
(a 1 s lease whose renewals stop), an idle agent's RSS, and `evidence
pull` of its store over each link against a local merge. The target is
build/targets/gf_target. Medians of REPS rounds. Prints JSON. Needs root
and `make build`.
"""

from __future__ import annotations

import json
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from agentproc import AgentProc, make_certs  # noqa: E402
from gftarget import LIB, Target  # noqa: E402

import gpufault  # noqa: E402

REPS = int(os.environ.get("GF_BENCH_AGENT_REPS", "5"))


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))


def rounds(c: gpufault.AgentClient, t: Target) -> dict[str, float]:
    arm, disarm = [], []
    for _ in range(REPS):
        t0 = time.perf_counter()
        h = c.arm(gpufault.Fault.fail(str(LIB), "gf_victim", ret=-5, nth=1), t.pid, duration=60)
        arm.append(time.perf_counter() - t0)
        assert [r[3] for r in t.victim(2)] == [-5, 3]
        t0 = time.perf_counter()
        h.disarm()
        disarm.append(time.perf_counter() - t0)
    return {"arm_s": statistics.median(arm), "disarm_s": statistics.median(disarm)}


def pulls(urls: list[str], db: Path, d: Path, ca: str, tok: Path) -> dict[str, object]:
    """`evidence pull` of the agent's store (every fire above) over each
    link, against a local `evidence merge` of the same file: the link's
    cost is the ratio. Medians of 3, each into a new store."""
    size = db.stat().st_size + sum(
        p.stat().st_size for p in db.parent.glob(db.name + "-wal") if p.exists()
    )
    res: dict[str, object] = {"store_kib": round(size / 1024)}
    ways = {
        "local_merge": lambda into: gpufault.merge_evidence([db], into, skip_running=True),
        "unix": lambda into: gpufault.pull_evidence([urls[0]], into),
        "tls": lambda into: gpufault.pull_evidence([urls[1]], into, ca=ca, token_file=tok),
    }
    for name, way in ways.items():
        ts = []
        for i in range(3):
            into = d / f"pull-{name}-{i}.db"
            t0 = time.perf_counter()
            way(into)
            ts.append(time.perf_counter() - t0)
        res[f"{name}_s"] = round(statistics.median(ts), 4)
    for name in ("unix", "tls"):
        res[f"{name}_vs_local_merge"] = round(res[f"{name}_s"] / res["local_merge_s"], 2)  # type: ignore[operator]
    return res


def main() -> None:
    d = Path(tempfile.mkdtemp(prefix="gf-bench-agent-"))
    certs = make_certs((d / "certs").mkdir() or d / "certs")
    tok = d / "token"
    tok.write_text("bench-token-0123456789abcdef\n")
    tok.chmod(0o600)
    db = d / "gf.db"
    a = AgentProc(["--listen", f"unix:{d}/run/agent.sock", "--listen", "tls://127.0.0.1:0",
                   "--cert", certs["server.pem"], "--key", certs["server.key"],
                   "--token-file", str(tok), "--db", str(db)])  # fmt: skip
    t = Target()
    out: dict[str, object] = {"host": platform.node(), "kernel": platform.release(),
                              "reps": REPS}  # fmt: skip
    try:
        time.sleep(1.0)  # settle: the RSS of an agent that has served nothing yet
        out["idle_rss_kib"] = rss_kib(a.pid)
        unix = gpufault.AgentClient.connect(a.urls[0])
        tls = gpufault.AgentClient.connect(a.urls[1], ca=certs["ca.pem"], token_file=tok)
        out["unix"] = rounds(unix, t)
        out["tls"] = rounds(tls, t)
        out["rss_after_rounds_kib"] = rss_kib(a.pid)
        # Fires streamed: every gf_empty call fails, as fast as the target calls.
        h = unix.arm(gpufault.Fault.fail(str(LIB), "gf_empty", ret=-5, sticky=True, stack=False),
                     t.pid, duration=60)  # fmt: skip
        t0 = time.perf_counter()
        t.cmd("pace 3000 1000")
        n0 = len(h.fired())
        while h.counters.fires < 3000 and time.perf_counter() - t0 < 20:
            time.sleep(0.01)
        el = time.perf_counter() - t0
        h.wait_fires(3000, timeout=10)
        out["fires_streamed"] = {"fires": len(h.fired()), "seconds": round(el, 3),
                                 "per_s": round(len(h.fired()) / el, 1), "before": n0}  # fmt: skip
        h.disarm()
        # Lease expiry: renewals stop; the agent's expiry time vs the last fire.
        lat = []
        for _ in range(3):
            spec = gpufault.Fault.fail(str(LIB), "gf_empty", ret=-5, sticky=True, stack=False)
            h = unix.arm(spec, t.pid, lease_s=1.0, duration=60)
            assert t.p.stdin is not None
            t.p.stdin.write("pace 2400 800\n")
            t.p.stdin.flush()
            time.sleep(0.5)
            h.stop_renewals()
            stopped = time.time()
            h.wait(10)
            for _ln in iter(t.p.stdout.readline, "done\n"):  # type: ignore[union-attr]
                pass
            con = sqlite3.connect(db)
            stats = json.loads(con.execute("SELECT stats FROM runs WHERE run_id=?",
                                           (h.run_id,)).fetchone()[0])  # fmt: skip
            last = con.execute("SELECT max(wall) FROM faults WHERE run_id=?",
                               (h.run_id,)).fetchone()[0]  # fmt: skip
            con.close()
            exp = stats["agent"]["lease_expired_at"]
            lat.append({"stop_to_expiry_s": round(exp - stopped, 4),
                        "expiry_to_last_fire_s": round(last - exp, 4)})  # fmt: skip
        out["lease_expiry"] = lat
        unix.close()
        tls.close()
        out["pull"] = pulls(a.urls, db, d, certs["ca.pem"], tok)
    finally:
        t.close()
        a.stop()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
