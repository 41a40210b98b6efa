"""Output divergence per flipped bit position on a tiny random transformer.

    python -m pyctl.hooks.tc_measure --model-dtype bf16 --as fp16 --rate 1e-3

For each bit position of the chosen dtype, every nn.Linear output (and,
with --matmul, every attention matmul output) has that bit flipped in a
`rate` share of its elements; the perturbed run is compared with the clean
run on the same input: top-1 agreement, mean and max |logit error|,
perplexity change (next-token targets from the input). Prints a markdown
table and, with --json, one JSON object per row.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass

import torch

from pyctl.hooks import tiny_model
from pyctl.hooks.bitflip import DTYPES, LAYOUT, BitSpecError
from pyctl.hooks.tc_perturb import MATMUL, Perturber, Rule


@dataclass
class Row:
    bits: str
    flips: int
    top1_agree: float
    logit_err_mean: float
    logit_err_max: float
    nonfinite: int
    ppl_clean: float
    ppl_perturbed: float


def bit_specs(dtype: torch.dtype) -> list[str]:
    """Every bit of the dtype by name, most significant first."""
    total, exp, mant = LAYOUT[dtype]
    if dtype == torch.int8:
        return ["sign"] + [f"bit:{i}" for i in range(6, -1, -1)]
    return (
        ["sign"]
        + [f"exp:{i}" for i in range(exp - 1, -1, -1)]
        + [f"mant:{i}" for i in range(mant - 1, -1, -1)]
    )


def _ppl(logits: torch.Tensor, targets: torch.Tensor) -> float:
    lp = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="mean"
    )
    v = float(lp)
    return math.exp(v) if math.isfinite(v) and v < 700 else math.inf


def compare(
    clean: torch.Tensor, pert: torch.Tensor, targets: torch.Tensor, bits: str, flips: int
) -> Row:
    c, p = clean.float(), pert.float()
    finite = torch.isfinite(p)
    err = (c - p).abs()
    err = torch.where(finite, err, torch.zeros_like(err))
    return Row(
        bits=bits,
        flips=flips,
        top1_agree=float((c.argmax(-1) == p.argmax(-1)).float().mean()),
        logit_err_mean=float(err.mean()),
        logit_err_max=float(err.max()),
        nonfinite=int((~finite).sum()),
        ppl_clean=_ppl(c, targets),
        ppl_perturbed=_ppl(p, targets),
    )


def measure(
    model_dtype: str = "fp32",
    as_dtype: str | None = None,
    rate: float = 1e-3,
    seed: int = 0,
    layers: str = "*",
    matmul: bool = False,
    device: str = "cpu",
    bits: list[str] | None = None,
    events: list[dict[str, object]] | None = None,
) -> list[Row]:
    """One Row per bit spec; with `events`, also one dict per layer that
    flipped (bits, layer, rate, counts, the row's divergence) for the store."""
    mdt = DTYPES[model_dtype]
    fdt = DTYPES[as_dtype] if as_dtype else mdt
    model = tiny_model.build(seed=seed, dtype=mdt, device=device)
    ids = tiny_model.batch(seed=seed + 1, device=device)
    inp, targets = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        clean = model(inp)
        rows = []
        for spec in bits or bit_specs(fdt):
            rules = [Rule(layers, spec, rate, as_dtype)]
            if matmul:
                rules.append(Rule(MATMUL, spec, rate, as_dtype))
            with Perturber(rules, seed=seed).attach(model) as p:
                pert = model(inp)
            rows.append(compare(clean, pert, targets, spec, p.total_bits))
            if events is not None:
                row = asdict(rows[-1])
                for layer, c in p.counts.items():
                    events.append(
                        {
                            "bits": spec,
                            "layer": layer,
                            "pid": os.getpid(),
                            "rate": rate,
                            "dtype": str(fdt).removeprefix("torch."),
                            "model_dtype": model_dtype,
                            "seed": seed,
                            "calls": c.calls,
                            "elements_flipped": c.elements,
                            "bits_flipped": c.bits,
                            "top1_agree": row["top1_agree"],
                            "nonfinite": row["nonfinite"],
                        }
                    )
    return rows


def table(rows: list[Row]) -> str:
    out = [
        "| bits | flips | top-1 agree | mean abs logit err | max abs logit err |"
        " non-finite | ppl clean -> perturbed |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        out.append(
            f"| {r.bits} | {r.flips} | {r.top1_agree:.4f} | {r.logit_err_mean:.3g} |"
            f" {r.logit_err_max:.3g} | {r.nonfinite} |"
            f" {r.ppl_clean:.4g} -> {r.ppl_perturbed:.4g} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--as", dest="as_dtype", default=None, choices=list(DTYPES))
    ap.add_argument("--rate", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", default="*", help="fnmatch over nn.Linear names")
    ap.add_argument("--matmul", action="store_true", help="also attention matmul outputs")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--bits", default=None, help="comma-separated bit specs (default: all)")
    ap.add_argument("--json", action="store_true")
    # `gpufault hooks tc-measure` reads the per-layer counts from here.
    ap.add_argument("--gf-events", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    events: list[dict[str, object]] | None = [] if a.gf_events else None
    try:
        rows = measure(
            a.model_dtype,
            a.as_dtype,
            a.rate,
            a.seed,
            a.layers,
            a.matmul,
            a.device,
            a.bits.split(",") if a.bits else None,
            events,
        )
    except BitSpecError as e:
        print(f"tc_measure: {e}", file=sys.stderr)
        return 2
    if a.gf_events and events is not None:
        with open(a.gf_events, "w") as f:
            f.writelines(json.dumps(e) + "\n" for e in events)
    if a.json:
        for r in rows:
            print(json.dumps(asdict(r)))
    else:
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
