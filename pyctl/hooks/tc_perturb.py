"""Tensor Core precision perturbation as an in-process torch hook (class 4).

Flip chosen bits of matmul outputs at a rate, per layer, deterministically:

    rules = [Rule("blocks.0.*", "exp:4", 1e-3, as_dtype="fp16"),
             Rule("matmul", "sign", 1e-2)]
    with Perturber(rules, seed=7).attach(model) as p:
        logits = model(ids)
    p.counts  # {"blocks.0.qkv": Count(calls=1, elements=.., bits=..), ...}

A rule's pattern is an fnmatch pattern over nn.Linear module names (their
forward outputs are perturbed), or "matmul" for the outputs of torch.matmul,
mm, bmm and the @ operator (attention scores and mixing), seen through a
TorchFunctionMode while the Perturber is active. `as_dtype` flips the bits
the value would have in that dtype (fp16 on CPUs that have no fp16 matmul,
int8 for a quantised GEMM); by default the output's own dtype is used.
Each rule/layer pair draws from its own generator seeded from (seed, name),
so a run is reproducible and one layer's draws do not shift another's.
"""

from __future__ import annotations

import fnmatch
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from pyctl.hooks.bitflip import DTYPES, BitSpecError, bit_positions, flip_as

MATMUL = "matmul"
_MATMUL_FUNCS = {
    torch.matmul,
    torch.mm,
    torch.bmm,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.Tensor.__rmatmul__,
}


@dataclass(frozen=True)
class Rule:
    pattern: str  # fnmatch over nn.Linear names, or "matmul"
    bits: str  # bit spec, see hooks.bitflip
    rate: float  # share of output elements flipped per call
    as_dtype: str | None = None  # fp16 | bf16 | fp32 | int8; None: the output's

    def check(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise BitSpecError(f"rate {self.rate} is not a probability: use 0..1")
        if self.as_dtype is not None and self.as_dtype not in DTYPES:
            raise BitSpecError(f"as_dtype {self.as_dtype!r}: use one of {' '.join(DTYPES)}")
        if self.as_dtype is not None:
            bit_positions(self.bits, DTYPES[self.as_dtype])
            return
        # The output's own dtype is known only at the first call: the spec
        # must at least name bits some dtype has, or every call would fail.
        errors = []
        for dt in DTYPES.values():
            try:
                bit_positions(self.bits, dt)
                return
            except BitSpecError as e:
                errors.append(str(e))
        raise BitSpecError(errors[0])


def parse_rule(text: str) -> Rule:
    """`PATTERN@BITS@RATE[@DTYPE]`, e.g. `blocks.*.up@exp:4@1e-3@fp16`."""
    parts = text.split("@")
    if len(parts) not in (3, 4):
        raise BitSpecError(f"rule {text!r}: use PATTERN@BITS@RATE[@DTYPE], e.g. head@sign@0.01")
    try:
        rate = float(parts[2])
    except ValueError:
        raise BitSpecError(f"rule {text!r}: rate {parts[2]!r} is not a number") from None
    r = Rule(parts[0], parts[1], rate, parts[3] if len(parts) == 4 else None)
    r.check()
    return r


@dataclass
class Count:
    calls: int = 0
    elements: int = 0
    bits: int = 0


@dataclass
class Perturber:
    rules: list[Rule]
    seed: int = 0
    counts: dict[str, Count] = field(default_factory=dict)
    _handles: list[Any] = field(default_factory=list)
    _gens: dict[tuple[str, str], torch.Generator] = field(default_factory=dict)
    _mode: TorchFunctionMode | None = None
    _matmul_calls: int = 0

    def __post_init__(self) -> None:
        for r in self.rules:
            r.check()

    # -- lifecycle
    def attach(self, model: nn.Module) -> Perturber:
        """Hook every nn.Linear that a rule names; start the matmul mode."""
        hooked = 0
        for name, mod in model.named_modules():
            if not isinstance(mod, nn.Linear):
                continue
            rules = [
                r
                for r in self.rules
                if r.pattern != MATMUL and fnmatch.fnmatchcase(name, r.pattern)
            ]
            if rules:
                self._handles.append(mod.register_forward_hook(self._hook(name, rules)))
                hooked += 1
        wanted = [r for r in self.rules if r.pattern != MATMUL]
        if wanted and not hooked:
            names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
            raise BitSpecError(
                f"no nn.Linear matches {[r.pattern for r in wanted]}; names look like "
                f"{', '.join(names[:4])}"
            )
        mm = [r for r in self.rules if r.pattern == MATMUL]
        if mm:
            self._mode = _MatmulMode(self, mm)
            self._mode.__enter__()
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

    def __enter__(self) -> Perturber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def new_pass(self) -> None:
        """Number matmul outputs from 0 again (matmul#N is the Nth call of a
        pass): call it before each forward pass or batch of a long run."""
        self._matmul_calls = 0

    def reseed(self) -> None:
        """Start every generator over: the next run flips the same elements."""
        self._gens.clear()
        self.counts.clear()
        self._matmul_calls = 0

    # -- work
    def _gen(self, name: str, rule: Rule, device: torch.device) -> torch.Generator:
        key = (name, f"{rule.pattern}@{rule.bits}@{rule.rate}@{rule.as_dtype}")
        g = self._gens.get(key)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed((self.seed * 0x9E3779B1 + zlib.crc32("|".join(key).encode())) % 2**63)
            self._gens[key] = g
        return g

    def perturb(self, name: str, rules: list[Rule], out: torch.Tensor) -> torch.Tensor:
        c = self.counts.setdefault(name, Count())
        c.calls += 1
        for r in rules:
            dtype = DTYPES[r.as_dtype] if r.as_dtype else out.dtype
            res = flip_as(
                out, dtype, bit_positions(r.bits, dtype), r.rate, self._gen(name, r, out.device)
            )
            out = res.tensor
            c.elements += res.elements
            c.bits += res.bits
        return out

    def _hook(self, name: str, rules: list[Rule]) -> Callable[..., torch.Tensor]:
        def hook(_mod: nn.Module, _inp: Any, out: torch.Tensor) -> torch.Tensor:
            return self.perturb(name, rules, out)

        return hook

    @property
    def total_bits(self) -> int:
        return sum(c.bits for c in self.counts.values())


class _MatmulMode(TorchFunctionMode):
    """Perturbs what torch.matmul & co. return while active."""

    def __init__(self, owner: Perturber, rules: list[Rule]) -> None:
        super().__init__()
        self.owner = owner
        self.rules = rules

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _MATMUL_FUNCS and isinstance(out, torch.Tensor) and out.is_floating_point():
            # Named by call order in the forward pass ("matmul#0", ...),
            # which is stable from one run of the same model to the next.
            name = f"{MATMUL}#{self.owner._matmul_calls}"
            self.owner._matmul_calls += 1
            out = self.owner.perturb(name, self.rules, out)
        return out
