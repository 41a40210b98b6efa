"""Bit flips in tensors: named bit positions per dtype, seeded selection.

A "bit spec" names bits by field so a table reads the same across dtypes:
``sign``, ``exp:N`` (exponent bit N, 0 = least significant), ``mant:N``
(mantissa bit N, 0 = least significant), ``bit:N`` (raw bit N), ``low:N``
(INT8: the N lowest bits). Several may be joined with ``+``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyctl.exceptions import BadInput

# (total bits, exponent bits, mantissa bits); int8 has no exponent.
LAYOUT: dict[torch.dtype, tuple[int, int, int]] = {
    torch.float16: (16, 5, 10),
    torch.bfloat16: (16, 8, 7),
    torch.float32: (32, 8, 23),
    torch.int8: (8, 0, 7),
}
_INT_VIEW = {16: torch.int16, 32: torch.int32, 8: torch.int8}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "int8": torch.int8}


class BitSpecError(BadInput):
    """A bit spec that does not fit the dtype; the message says what does."""


def bit_positions(spec: str, dtype: torch.dtype) -> list[int]:
    """Raw bit indexes (0 = least significant) named by `spec` for `dtype`."""
    if dtype not in LAYOUT:
        raise BitSpecError(f"unsupported dtype {dtype}: use one of fp16 bf16 fp32 int8")
    total, exp, mant = LAYOUT[dtype]
    bits: list[int] = []
    for part in spec.split("+"):
        name, _, idx = part.strip().partition(":")
        try:
            n = int(idx) if idx else 0
        except ValueError:
            raise BitSpecError(f"bad bit index in {part!r}: use e.g. exp:3") from None
        if name == "sign" and not idx:
            bits.append(total - 1)
        elif name == "exp" and idx and exp and 0 <= n < exp:
            bits.append(mant + n)
        elif name == "mant" and idx and dtype != torch.int8 and 0 <= n < mant:
            bits.append(n)
        elif name == "low" and idx and dtype == torch.int8 and 1 <= n <= 7:
            bits.extend(range(n))
        elif name == "bit" and idx and 0 <= n < total:
            bits.append(n)
        else:
            raise BitSpecError(
                f"bit spec {part!r} does not fit {str(dtype).removeprefix('torch.')}"
                f" (sign, exp:0..{exp - 1}, mant:0..{mant - 1}, bit:0..{total - 1},"
                f" int8: low:1..7)"
            )
    return sorted(set(bits))


def mask_of(bits: list[int], dtype: torch.dtype) -> int:
    """The XOR mask as a signed integer of the dtype's width."""
    total = LAYOUT[dtype][0]
    m = sum(1 << b for b in bits)
    return m - (1 << total) if m >= 1 << (total - 1) else m


@dataclass
class FlipResult:
    tensor: torch.Tensor
    elements: int  # elements whose bits were flipped
    bits: int  # bits flipped in all (elements x bits per element)


def flip(t: torch.Tensor, bits: list[int], rate: float, gen: torch.Generator) -> FlipResult:
    """Return a copy of `t` in which a `rate` share of elements has `bits` XORed.

    Elements are picked by a uniform draw from `gen` (seeded by the caller),
    so the same seed, shape and rate pick the same elements.
    """
    if t.dtype not in LAYOUT:
        raise BitSpecError(f"unsupported dtype {t.dtype}: use one of fp16 bf16 fp32 int8")
    if not 0.0 <= rate <= 1.0:
        raise BitSpecError(f"rate {rate} is not a probability: use 0..1")
    view = _INT_VIEW[LAYOUT[t.dtype][0]]
    pick = torch.rand(t.shape, generator=gen, device=t.device) < rate
    n = int(pick.sum())
    if n == 0 or not bits:
        return FlipResult(t, 0, 0)
    ints = t.contiguous().view(view)
    flipped = torch.where(pick, ints ^ mask_of(bits, t.dtype), ints)
    return FlipResult(flipped.view(t.dtype), n, n * len(bits))


def flip_as(
    t: torch.Tensor, dtype: torch.dtype, bits: list[int], rate: float, gen: torch.Generator
) -> FlipResult:
    """Flip bits of `t` as if it were stored in `dtype`, keeping t's dtype.

    fp16 on a CPU (no fp16 matmul there): the value is rounded to fp16, its
    bits flipped, and converted back, for the picked elements only. int8:
    per-tensor symmetric quantisation (scale = max|t| / 127), flip, and
    dequantise, standing for the output of an INT8 GEMM.
    """
    if dtype == t.dtype:
        return flip(t, bits, rate, gen)
    if dtype == torch.int8:
        scale = t.detach().abs().max().clamp_min(1e-12) / 127.0
        q = torch.clamp(torch.round(t / scale), -127, 127).to(torch.int8)
        r = flip(q, bits, rate, gen)
        if r.elements == 0:
            return FlipResult(t, 0, 0)
        changed = r.tensor != q
        out = torch.where(changed, r.tensor.to(t.dtype) * scale, t)
        return FlipResult(out, r.elements, r.bits)
    r = flip(t.to(dtype), bits, rate, gen)
    if r.elements == 0:
        return FlipResult(t, 0, 0)
    changed = r.tensor.view(_INT_VIEW[LAYOUT[dtype][0]]) != t.to(dtype).view(
        _INT_VIEW[LAYOUT[dtype][0]]
    )
    return FlipResult(torch.where(changed, r.tensor.to(t.dtype), t), r.elements, r.bits)
