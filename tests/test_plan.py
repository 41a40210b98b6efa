"""pyctl/engine/mechanism.py: every decision of how a fault is carried out,
asked of one Plan (no root, no BPF: the kernel's answers are given)."""

from __future__ import annotations

import os

import pytest

from pyctl.bpf import abi
from pyctl.engine import Plan
from pyctl.spec import FaultSpec

FAIL_SKIP = FaultSpec(lib="libc", fn="getpid", action="fail", ret=-5)
FAIL_AFTER = FaultSpec(lib="libc", fn="getpid", action="fail", ret=-5, mode="after")
CORRUPT = FaultSpec(lib="libc", fn="getpid", action="corrupt", corrupt=(1, 0, 0, 0, 8))
STALL = FaultSpec(lib="libc", fn="getpid", action="stall", stall_ms=5)
TRACE = FaultSpec(lib="libc", fn="getpid", trace=True)
MECH = abi.F_REGS | abi.F_COPILOT | abi.F_RETPROBE


@pytest.mark.parametrize(
    ("spec", "regs", "wu", "mechanism", "copilot"),
    [
        (TRACE, False, False, "bpf", False),
        (FAIL_SKIP, True, False, "regs", False),
        (FAIL_SKIP, False, False, "copilot", True),
        (CORRUPT, False, True, "bpf", False),
        (CORRUPT, True, False, "copilot", True),
        (STALL, True, True, "copilot", True),
    ],
)
def test_mechanism_and_copilot(
    spec: FaultSpec, regs: bool, wu: bool, mechanism: str, copilot: bool
) -> None:
    p = Plan([spec], regs=regs, user_writes=wu)
    assert (p.mechanism, p.needs_copilot()) == (mechanism, copilot)


def test_programs_follow_the_kernels_answers() -> None:
    assert Plan([], regs=False, user_writes=False).programs == ("gf_entry", "gf_return")
    assert Plan([], regs=True, user_writes=True).programs == ("gf_entry_regs", "gf_return_regs_wu")


@pytest.mark.parametrize(
    ("spec", "regs", "wu", "flags"),
    [
        (FAIL_SKIP, True, False, abi.F_REGS),  # regs skip: no return probe
        (FAIL_SKIP, False, False, abi.F_COPILOT),
        (FAIL_AFTER, True, False, abi.F_REGS | abi.F_RETPROBE),
        (CORRUPT, False, True, abi.F_RETPROBE),
        (CORRUPT, False, False, abi.F_COPILOT | abi.F_RETPROBE),
        (STALL, True, True, abi.F_COPILOT),
        (TRACE, True, True, abi.F_RETPROBE),
    ],
)
def test_each_spec_is_armed_with_its_mechanism_flags(
    spec: FaultSpec, regs: bool, wu: bool, flags: int
) -> None:
    p = Plan([spec.validate()], regs=regs, user_writes=wu)
    atts = p.attachments(os.getpid())
    assert atts and all(a.spec == 0 for a in atts)
    cfg = p.bpf_spec(0, atts, start_mono_ns=0, tgid=42, tid=0, duration_s=0.0)
    assert cfg.flags & MECH == flags
    assert cfg.flags & abi.F_ENABLED and cfg.tgid == 42


def test_a_caller_range_not_mapped_yet_matches_nothing() -> None:
    sp = FaultSpec(lib="libc", fn="getpid", action="fail", ret=-5, caller="main").validate()
    p = Plan([sp], regs=True, user_writes=True)
    atts = p.attachments(os.getpid())
    kw = {"start_mono_ns": 0, "tgid": 0, "tid": 0, "duration_s": 0.0}
    assert (p.bpf_spec(0, atts, **kw).caller_lo, p.bpf_spec(0, atts, **kw).caller_hi) == (1, 1)
    cfg = p.bpf_spec(0, atts, caller=(0x1000, 0x2000), **kw)
    assert (cfg.caller_lo, cfg.caller_hi) == (0x1000, 0x2000)


def test_single_links_after_a_refused_multi_load() -> None:
    p = Plan([TRACE], regs=False, user_writes=False, multi=True)
    p.single_links()
    assert p.multi is False
