"""Attach and detach time of many probes, one run on this machine.

A sleeping process gets probes on ~100 libc functions (trace, entry and
return), once with uprobe_multi links (one link per file and direction,
where the kernel has them) and once with a link per site (what older
kernels get). Detaching a per-site link waits for RCU grace periods in the
kernel, so closing is where the two differ. Prints JSON.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))  # an installed gpufault (the wheel) wins, else this checkout

from pyctl import capabilities, engine  # noqa: E402
from pyctl.engine import Engine  # noqa: E402
from pyctl.spec import FaultSpec  # noqa: E402

PATTERNS = ("str*", "mem*", "pthread_mutex*", "pthread_cond*", "pthread_attr*")


def once(pid: int, db: Path, multi: bool) -> dict:
    engine.uprobe_multi = lambda: multi  # type: ignore[assignment]
    specs = [FaultSpec(lib="libc", fn=f, trace=True, capture_stack=False, tgid=pid)
             for f in PATTERNS]
    eng = Engine(specs, db_path=db, pid=pid, argv=["bench-detach"], kind="trace")
    t0 = time.monotonic()
    eng.start()
    t1 = time.monotonic()
    sites = len(eng.atts)
    links = len(eng.obj.link_fds) + len(eng.obj.links)  # type: ignore[union-attr]
    eng.close()
    return {"sites": sites, "links": links, "start_s": round(t1 - t0, 4),
            "close_s": round(time.monotonic() - t1, 4)}


def main() -> None:
    out: dict = {"machine": platform.node(), "kernel": platform.release(),
                 "cpus": os.cpu_count(), "uprobe_multi": capabilities.uprobe_multi()}
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with tempfile.TemporaryDirectory() as d:
            db = Path(d) / "d.db"
            modes = [True, False] if out["uprobe_multi"] else [False]
            for m in modes:
                runs = [once(p.pid, db, m) for _ in range(3)]
                out["multi" if m else "per_site"] = {
                    "runs": runs, "best_close_s": min(r["close_s"] for r in runs)}
            if out["uprobe_multi"]:
                out["close_ratio_per_site_to_multi"] = round(
                    out["per_site"]["best_close_s"] / out["multi"]["best_close_s"], 1)
    finally:
        p.kill()
        p.wait()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
