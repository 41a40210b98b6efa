"""The signal fast path (issue 26): fail-skips carried out inside the target.

gfsig.so (gfsig.c here, built into pyctl/data/helper/) is loaded once into
the running target by a ptrace-driven dlopen (inject.py); each fire is
bpf_send_signal_thread from the entry uprobe, and the helper's handler
returns from the probed call with the spec's value (sites.py says where the
thread is at the signal and how to find the entry sp). The engine tries it
when asked and falls back to the ptrace copilot with the reason
(docs/copilot.md, "The signal fast path").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pyctl.fastpath.inject import FastpathError, Helper, SignalTaken, find_runtime, load
from pyctl.fastpath.sites import STALL, Site, SiteError, decode, read_insn


def load_for(
    pid: int,
    signo: int,
    specs: Sequence[Any],
    atts: Sequence[Any],
    deadline_ns: int = 0,
    only: set[int] | None = None,
) -> Helper:
    """Sites of the engine's attachments (pyctl.engine.mechanism.Attachment:
    lib, sym, spec) of the specs in `only` (None: every fail and stall),
    then load(). One value per site: two fail specs on one function are
    refused (the handler cannot tell them apart)."""
    sites: dict[int, Site] = {}
    for a in atts:
        sp = specs[a.spec]
        if sp.action not in ("fail", "stall") or (only is not None and a.spec not in only):
            continue
        try:
            length, delta = decode(read_insn(a.lib.path, a.sym.offset))
        except (SiteError, OSError, IndexError) as e:
            raise FastpathError(f"{a.sym.name}: {e}") from None
        addr = find_runtime(pid, a.lib, a.sym.offset)
        if sp.action == "stall":
            site = Site(addr + length, delta, 0, 0, STALL, int(sp.stall_ms * 1e6))
        else:
            site = Site(addr + length, delta, int(sp.ret), int(sp.errno or 0))
        if addr in sites and sites[addr] != site:
            raise FastpathError(f"{a.sym.name}: two faults of the signal path on one site")
        sites[addr] = site
    return load(pid, signo, list(sites.values()), deadline_ns)


__all__ = [
    "FastpathError",
    "Helper",
    "SignalTaken",
    "Site",
    "SiteError",
    "decode",
    "load",
    "load_for",
]
