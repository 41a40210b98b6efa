"""ptrace copilot: finishes fail/stall injections that BPF cannot do itself
on kernels that refuse register writes from uprobe programs."""

from pyctl.sigmask import block_sigchld

from .model import GF_ACT_FAIL, GF_ACT_STALL, GF_F_AFTER, CopilotError, Injection, Outcome
from .tracer import Copilot, check_not_traced

__all__ = [
    "GF_ACT_FAIL",
    "GF_ACT_STALL",
    "GF_F_AFTER",
    "Copilot",
    "CopilotError",
    "Injection",
    "Outcome",
    "block_sigchld",
    "check_not_traced",
]
