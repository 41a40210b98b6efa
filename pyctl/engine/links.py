"""The run's BPF object: load it, attach its programs (one link per site,
or uprobe_multi links), read its maps, detach. The map and program names
are pyctl/bpf/names.py's (checked there against the built object)."""

from __future__ import annotations

import ctypes as C
from collections.abc import Iterable, Sequence

from pyctl.bpf import abi
from pyctl.bpf.libbpf import (
    BpfError,
    Object,
    map_count,
    map_lookup,
    map_update,
)
from pyctl.bpf.main_object import (
    USTACK_BYTES,
    USTACKS_RING_BYTES,
    USTACKS_RING_UNUSED,
    LoadSettings,
    load,
    take_early,
)
from pyctl.bpf.names import Main
from pyctl.engine.errors import EngineError
from pyctl.engine.mechanism import Attachment, Plan


class Links:
    """One run's loaded object and its links, as the plan says."""

    def __init__(
        self,
        plan: Plan,
        *,
        ring_bytes: int,
        fires_ring_bytes: int,
        copilot_signal: int,
        ustack_bytes: int = USTACK_BYTES,
        helper_signal: int = 0,
    ) -> None:
        self.plan = plan
        self.ustack_bytes = ustack_bytes
        self.ring_bytes = ring_bytes
        self.fires_ring_bytes = fires_ring_bytes
        self.copilot_signal = copilot_signal
        self.helper_signal = helper_signal  # 0: the copilot's (pyctl/fastpath)
        self.obj: Object | None = None
        self._progs = ("", "")  # the entry and return programs load() chose

    def _open_and_load(self, multi: bool) -> tuple[Object, str, str]:
        settings = LoadSettings(
            programs=self.plan.programs,
            multi=multi,
            ring_bytes=self.ring_bytes,
            fires_ring_bytes=self.fires_ring_bytes,
            copilot_signal=self.copilot_signal,
            helper_signal=self.helper_signal,
            ustack_bytes=self.ustack_bytes,
            ustacks_ring_bytes=USTACKS_RING_BYTES
            if self.plan.copies_stacks() and self.ustack_bytes
            else USTACKS_RING_UNUSED,
        )
        # Loaded already by the entry (pyctl/bpf/main_object.py) when the
        # settings are the defaults it assumed.
        obj = take_early(settings) or load(settings)
        entry, ret = settings.programs
        return obj, entry, ret

    def load(self, watch: Iterable[int]) -> Object:
        """Load and mark the watched processes; nothing is attached yet, so
        the specs can be armed before the first call can reach a probe.
        Raises EngineError (the caller closes what was loaded)."""
        try:
            obj, entry, ret = self._open_and_load(self.plan.multi)
        except BpfError as e:
            if not self.plan.multi:
                raise EngineError(f"{e}: see `gpufault doctor`") from None
            # A kernel may take a program as a plain uprobe but not as a
            # uprobe_multi one (the register-writing pair, say): per-site links.
            self.plan.single_links()
            try:
                obj, entry, ret = self._open_and_load(False)
            except BpfError as e2:
                raise EngineError(f"{e2}: see `gpufault doctor`") from None
        self.obj = obj
        self._progs = (entry, ret)
        # The specs map stays all zero (every spec disabled) until arm().
        wfd = obj.map_fd(Main.WATCHED)
        for wpid in watch:
            map_update(wfd, C.c_uint32(wpid), C.c_uint8(1))
        return obj

    def attach(self, atts: Sequence[Attachment], pid: int | None) -> None:
        """The tracepoints and every site, once loaded (load()); raises
        EngineError (the caller closes what was attached)."""
        obj = self.obj
        assert obj is not None
        entry, ret = self._progs
        obj.attach(Main.SIGNAL_DELIVER)
        obj.attach(Main.PROCESS_EXIT)
        attach_pid = pid if pid is not None else -1
        # Every entry probe, then every return probe. The specs are armed
        # already (Engine.arm) without F_RETPROBE: a call from the first
        # entry probe's first hit on counts, entry-only until the engine
        # sets F_RETPROBE once the return probes are in too (a return
        # probe then finds no entry for the calls before and does
        # nothing). Armed with F_RETPROBE from the start, a call that met
        # only the entry probe was counted and never returned: its
        # in-flight entry was overwritten by the thread's next call, in no
        # row and in no loss count (a trace of a 500k calls/s loop missed
        # its first 96-177 calls).
        for is_ret in (False, True):
            if self.plan.multi:
                self._attach_multi(obj, atts, entry, ret, attach_pid, is_ret)
                continue
            for a in atts:
                if is_ret and not a.retprobe:
                    continue
                ck = abi.cookie(a.spec, a.func)
                try:
                    obj.attach_uprobe(
                        ret if is_ret else entry, attach_pid, a.lib.path, a.sym.offset, ck, is_ret
                    )
                except BpfError as e:
                    raise EngineError(f"{e} ({a.sym.name}): see `gpufault doctor`") from None

    def _attach_multi(
        self,
        obj: Object,
        atts: Sequence[Attachment],
        entry: str,
        ret: str,
        pid: int,
        returns: bool,
    ) -> None:
        """One uprobe_multi link per (file, entry/return), so closing costs
        one kernel wait per link, not per site. A site may appear once per
        link: a function probed by two specs goes into a second link.
        returns: the return links, else the entry links."""
        groups: dict[tuple[str, bool, int], list[Attachment]] = {}
        taken: dict[tuple[str, bool, int], set[int]] = {}
        for a in atts:
            for is_ret in (False, True) if a.retprobe else (False,):
                rank = 0
                while a.sym.offset in taken.get((a.lib.path, is_ret, rank), ()):
                    rank += 1
                key = (a.lib.path, is_ret, rank)
                taken.setdefault(key, set()).add(a.sym.offset)
                groups.setdefault(key, []).append(a)
        for (path, is_ret, _), group in groups.items():
            if is_ret != returns:
                continue
            prog = ret if is_ret else entry
            offs = [a.sym.offset for a in group]
            cks = [abi.cookie(a.spec, a.func) for a in group]
            try:
                obj.attach_uprobe_multi(prog, pid, path, offs, cks, is_ret)
            except BpfError as e:
                # Name the site the kernel refused: try them one at a time.
                for a, off, ck in zip(group, offs, cks, strict=True):
                    try:
                        obj.attach_uprobe_multi(prog, pid, path, [off], [ck], is_ret)
                    except BpfError as one:
                        raise EngineError(f"{one} ({a.sym.name}): see `gpufault doctor`") from None
                raise EngineError(f"{e}: see `gpufault doctor`") from None

    # ---- maps ---------------------------------------------------------
    def map_fd(self, name: str) -> int:
        assert self.obj is not None
        return self.obj.map_fd(name)

    @property
    def events_fd(self) -> int:
        return self.map_fd(Main.EVENTS)

    @property
    def fires_fd(self) -> int:
        return self.map_fd(Main.FIRES)

    @property
    def ustacks_fd(self) -> int:
        return self.map_fd(Main.USTACKS)

    @property
    def ustacks_ring_bytes(self) -> int:
        """The ring's size as loaded (an early object's may be larger than
        this run asked for: LoadSettings.served_by)."""
        assert self.obj is not None
        return self.obj.max_entries(Main.USTACKS)

    @property
    def pending_fd(self) -> int:
        return self.map_fd(Main.PENDING)

    def write_spec(self, i: int, cfg: abi.Spec) -> None:
        map_update(self.map_fd(Main.SPECS), C.c_uint32(i), cfg)

    def counters(self, n: int) -> list[abi.Counters]:
        fd = self.map_fd(Main.COUNTERS)
        out = []
        for i in range(n):
            c = abi.Counters()
            map_lookup(fd, C.c_uint32(i), c)
            out.append(c)
        return out

    def _stats(self, names: tuple[str, ...], first: int) -> dict[str, int]:
        fd = self.map_fd(Main.STATS)
        out = {}
        for i, name in enumerate(names, first):
            v = C.c_uint64()
            map_lookup(fd, C.c_uint32(i), v)
            out[name] = v.value
        return out

    def lost(self) -> dict[str, int]:
        return self._stats(abi.STAT_NAMES, 0)

    def loss_causes(self) -> dict[str, int]:
        """Why events reservations failed (bpf/gpufault.bpf.c, events_lost())."""
        return self._stats(abi.LOSS_CAUSE_NAMES, len(abi.STAT_NAMES))

    def ustacks_lost(self) -> int:
        """Stack copies that found the ustacks ring full (their fires happened)."""
        at = len(abi.STAT_NAMES) + len(abi.LOSS_CAUSE_NAMES)
        return self._stats(abi.USTACK_STAT_NAMES, at)["ustacks_lost"]

    def in_flight(self) -> int:
        """Calls that entered and have not returned (after detach: never will)."""
        return map_count(self.map_fd(Main.INFLIGHT), 16)

    # ---- teardown -----------------------------------------------------
    def detach(self) -> None:
        if self.obj is not None:
            self.obj.detach_all()

    def close(self) -> None:
        if self.obj is not None:
            self.obj.close()
            self.obj = None
