"""Tensor Core precision perturbation (pyctl/hooks/bitflip, tc_perturb, tc_measure)
with the real CPU torch; fp16 bit handling is checked on tensors directly."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch==2.13.0")

from pyctl.hooks import tc_measure, tiny_model  # noqa: E402
from pyctl.hooks.bitflip import BitSpecError, bit_positions, flip, flip_as  # noqa: E402
from pyctl.hooks.tc_perturb import MATMUL, Perturber, Rule, parse_rule  # noqa: E402


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    "dtype, spec, before, after",
    [
        (torch.float16, "sign", 1.0, -1.0),
        (torch.float16, "mant:9", 1.0, 1.5),  # top mantissa bit = 0.5
        (torch.float16, "exp:0", 1.0, 0.5),  # 0x3C00 -> 0x3800
        (torch.float16, "exp:4", 1.0, float("inf")),  # 0x3C00 -> 0x7C00
        (torch.bfloat16, "sign", 2.0, -2.0),
        (torch.bfloat16, "mant:6", 1.0, 1.5),
        (torch.bfloat16, "exp:0", 1.0, 0.5),
        (torch.float32, "mant:22", 1.0, 1.5),
        (torch.float32, "exp:7", 1.0, float("inf")),
        (torch.int8, "bit:0", 4, 5),
        (torch.int8, "sign", 1, -127),
        (torch.int8, "low:2", 4, 7),
    ],
)
def test_named_bits_flip_the_right_bit(
    dtype: torch.dtype, spec: str, before: float, after: float
) -> None:
    t = torch.tensor([before], dtype=dtype)
    r = flip(t, bit_positions(spec, dtype), 1.0, gen())
    assert r.tensor.dtype == dtype and r.elements == 1
    assert r.tensor.item() == after


def test_fp16_bits_through_flip_as_keep_the_carrier_dtype() -> None:
    t = torch.tensor([1.0, 2.0, -3.0])
    r = flip_as(t, torch.float16, bit_positions("sign", torch.float16), 1.0, gen())
    assert r.tensor.dtype == torch.float32
    assert r.tensor.tolist() == [-1.0, -2.0, 3.0]
    # A value not representable in fp16 is untouched where not picked.
    x = torch.tensor([1.0 + 1e-6, 1.0 + 1e-6])
    picked = flip_as(x, torch.float16, [15], 0.0, gen())
    assert torch.equal(picked.tensor, x)


def test_int8_mode_quantises_flips_dequantises() -> None:
    t = torch.tensor([1.27, -0.5, 0.0])
    r = flip_as(t, torch.int8, bit_positions("sign", torch.int8), 1.0, gen())
    # 1.27 -> q=127 (0x7f) -> sign flip = -1 -> -0.01
    assert r.tensor[0].item() == pytest.approx(-0.01)
    assert r.elements == 3


def test_rate_and_seed() -> None:
    t = torch.ones(200_000)
    bits = bit_positions("sign", torch.float32)
    assert flip(t, bits, 0.0, gen()).elements == 0
    assert flip(t, bits, 1.0, gen()).elements == t.numel()
    a, b, c = (flip(t, bits, 0.01, gen(s)) for s in (5, 5, 6))
    assert torch.equal(a.tensor, b.tensor) and not torch.equal(a.tensor, c.tensor)
    # 1 % of 200000: mean 2000, sd about 44.
    assert 1750 < a.elements < 2250
    assert int((a.tensor < 0).sum()) == a.elements == a.bits


@pytest.mark.parametrize(
    "spec, dtype",
    [
        ("exp:5", torch.float16),
        ("mant:7", torch.bfloat16),
        ("exp:1", torch.int8),
        ("bogus", torch.float32),
        ("mant:x", torch.float16),
        ("low:9", torch.int8),
    ],
)
def test_bad_bit_specs_are_one_line_errors(spec: str, dtype: torch.dtype) -> None:
    with pytest.raises(BitSpecError) as e:
        bit_positions(spec, dtype)
    assert "\n" not in str(e.value)


def test_bad_rules() -> None:
    for text in ("head@sign", "head@sign@lots", "head@sign@2", "head@sign@0.1@fp8"):
        with pytest.raises(BitSpecError):
            parse_rule(text)
    assert parse_rule("blocks.*@exp:3@1e-3@fp16") == Rule("blocks.*", "exp:3", 1e-3, "fp16")


@pytest.fixture(scope="module")
def model_and_input() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    m = tiny_model.build(seed=3)
    ids = tiny_model.batch(seed=4)[:, :-1]
    with torch.no_grad():
        clean = m(ids)
    return m, ids, clean


def test_hooks_count_flips_per_layer_and_detach_cleanly(model_and_input) -> None:  # type: ignore[no-untyped-def]
    m, ids, clean = model_and_input
    rules = [Rule("blocks.0.*", "sign", 0.01)]
    with torch.no_grad(), Perturber(rules, seed=1).attach(m) as p:
        out = m(ids)
    assert set(p.counts) == {"blocks.0.qkv", "blocks.0.proj", "blocks.0.up", "blocks.0.down"}
    assert all(c.calls == 1 and c.elements > 0 for c in p.counts.values())
    assert not torch.equal(out, clean)
    with torch.no_grad():
        assert torch.equal(m(ids), clean)  # hooks gone


def test_same_seed_same_output_other_seed_differs(model_and_input) -> None:  # type: ignore[no-untyped-def]
    m, ids, _ = model_and_input
    outs = []
    for seed in (1, 1, 2):
        with torch.no_grad(), Perturber([Rule("*", "exp:2", 0.005)], seed=seed).attach(m):
            outs.append(m(ids))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def test_reseed_repeats_flips_within_one_perturber(model_and_input) -> None:  # type: ignore[no-untyped-def]
    m, ids, _ = model_and_input
    with torch.no_grad(), Perturber([Rule("head", "mant:20", 0.1)], seed=9).attach(m) as p:
        a = m(ids)
        n = p.total_bits
        p.reseed()
        b = m(ids)
        assert p.total_bits == n
    assert torch.equal(a, b)


def test_matmul_mode_hits_attention_matmuls(model_and_input) -> None:  # type: ignore[no-untyped-def]
    m, ids, clean = model_and_input
    with torch.no_grad(), Perturber([Rule(MATMUL, "sign", 0.02)], seed=1).attach(m) as p:
        out = m(ids)
    # Two attention matmuls per block, two blocks; no nn.Linear touched.
    assert sorted(p.counts) == [f"matmul#{i}" for i in range(4)]
    assert not torch.equal(out, clean)
    # The mode is gone after exit.
    with torch.no_grad():
        assert torch.equal(m(ids), clean)


def test_unmatched_pattern_is_an_error(model_and_input) -> None:  # type: ignore[no-untyped-def]
    m, _, _ = model_and_input
    with pytest.raises(BitSpecError, match="no nn.Linear matches"):
        Perturber([Rule("decoder.*", "sign", 0.1)]).attach(m)


def test_divergence_grows_with_bit_significance() -> None:
    rows = tc_measure.measure(
        "fp32", "fp16", 2e-3, seed=0, bits=["exp:4", "exp:3", "sign", "mant:9", "mant:0"]
    )
    by = {r.bits: r for r in rows}
    print(tc_measure.table(rows))
    assert by["exp:4"].nonfinite > 0  # exponent MSB of fp16 1.x gives inf
    assert by["mant:0"].top1_agree == 1.0
    assert by["mant:0"].logit_err_mean < by["mant:9"].logit_err_mean < by["exp:3"].logit_err_mean
    assert by["sign"].top1_agree < 1.0
    assert all(r.flips > 0 for r in rows)


def test_measure_cli_json_and_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert tc_measure.main(["--bits", "sign,mant:0", "--rate", "1e-3", "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["bits"] for r in rows] == ["sign", "mant:0"]
    assert tc_measure.main(["--bits", "exp:9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tc_measure: ") and err.count("\n") == 1
