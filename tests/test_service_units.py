"""The reference service's parts, in-process: breaker, worker, model, double."""

from __future__ import annotations

import threading
import time

import pytest

from pyctl import paths
from pyctl.service.batcher import Outcome, Pending, QueueFull, Worker
from pyctl.service.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from pyctl.service.config import ServiceConfig


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


# ---- breaker ---------------------------------------------------------------------


def test_breaker_opens_after_n_consecutive_errors_and_recovers_through_half_open() -> None:
    clk, seen = Clock(), []
    b = CircuitBreaker(3, 10.0, 2.0, clock=clk, on_change=lambda o, n: seen.append((o, n)))
    assert b.use_primary() and b.state == CLOSED
    b.failure("x")
    b.failure("x")
    assert b.state == CLOSED
    b.failure("cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY")
    assert b.state == OPEN and not b.use_primary()
    assert b.snapshot().last_error == "cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY"
    clk.t += 1.9
    assert not b.use_primary()  # still cooling down
    clk.t += 0.2
    assert b.use_primary() and b.state == HALF_OPEN  # the probe
    b.failure("again")  # a failed probe: open for another cooldown
    assert b.state == OPEN and not b.use_primary()
    clk.t += 2.0
    assert b.use_primary() and b.state == HALF_OPEN
    b.success()
    assert b.state == CLOSED and b.snapshot().trips == 2
    assert seen == [
        (CLOSED, OPEN),
        (OPEN, HALF_OPEN),
        (HALF_OPEN, OPEN),
        (OPEN, HALF_OPEN),
        (HALF_OPEN, CLOSED),
    ]


def test_breaker_counts_only_consecutive_errors_within_the_window() -> None:
    clk = Clock()
    b = CircuitBreaker(3, 5.0, 1.0, clock=clk)
    b.failure("a")
    b.failure("a")
    b.success()  # the run is broken
    b.failure("a")
    b.failure("a")
    assert b.state == CLOSED
    clk.t += 6.0  # the two errors fall out of the window
    b.failure("a")
    assert b.state == CLOSED and b.snapshot().consecutive_errors == 1
    b.failure("a")
    b.failure("a")
    assert b.state == OPEN


# ---- worker ----------------------------------------------------------------------


def _pending(i: int, timeout: float = 30.0) -> Pending:
    return Pending(f"r{i}", [1, 2], 1, 0.0, i, deadline=time.monotonic() + timeout)


def test_worker_batches_up_to_max_batch_and_sheds_when_full() -> None:
    gate, batches = threading.Event(), []

    def run(batch: list[Pending]) -> None:
        gate.wait(10)  # the first batch holds the worker until the queue is full
        batches.append([p.id for p in batch])
        for p in batch:
            p.finish(Outcome(200, {"id": p.id}))

    w = Worker(run, max_batch=3, batch_wait_s=0.5, queue_size=4)
    w.start()
    try:
        first = _pending(0)
        w.submit(first)
        while w.depth():  # the worker has taken it and waits in run()
            pass
        while w.busy_since is None:
            pass
        ps = [_pending(i) for i in range(1, 5)]
        for p in ps:
            w.submit(p)
        with pytest.raises(QueueFull):
            w.submit(_pending(9))
        gate.set()
        for p in [first, *ps]:
            assert p.done.wait(10) and p.outcome is not None and p.outcome.status == 200
        assert batches == [["r0"], ["r1", "r2", "r3"], ["r4"]]
        assert w.tid is not None and w.thread.name == "gf-worker"
    finally:
        gate.set()
        w.stop()


def test_worker_skips_expired_requests_and_survives_a_failing_batch() -> None:
    def run(batch: list[Pending]) -> None:
        raise ValueError("boom")

    w = Worker(run, max_batch=2, batch_wait_s=0.0, queue_size=4)
    expired = _pending(1, timeout=-1.0)
    bad = _pending(2)
    w.submit(expired)
    w.submit(bad)
    w.start()
    try:
        assert expired.done.wait(5) and expired.outcome is not None
        assert expired.outcome.status == 504
        assert bad.done.wait(5) and bad.outcome is not None and bad.outcome.status == 500
        assert "boom" in bad.outcome.body["error"]["message"]
        assert w.alive()
    finally:
        w.stop()


# ---- model and decoding ----------------------------------------------------------


def test_generation_is_exact_length_seeded_and_padding_invariant() -> None:
    from pyctl.service.generate import GenRequest, generate
    from pyctl.service.model import build_model

    kw = dict(vocab_size=500, d_model=32, n_heads=4, n_layers=2, max_context=64)
    m1, m2 = build_model(**kw, seed=7), build_model(**kw, seed=7)
    short, long = GenRequest([5, 6, 7], 6), GenRequest(list(range(10, 30)), 3)
    alone = generate(m1, [short], pad_id=0)
    batched = generate(m2, [short, long], pad_id=0)
    # Left padding and masking: a row's answer does not depend on its batch.
    assert batched[0] == alone[0] and len(batched[1]) == 3
    assert len(alone[0]) == 6
    banned = generate(m1, [short], pad_id=0, banned=list(range(0, 500, 2)))
    assert all(t % 2 for t in banned[0])
    t1 = generate(m1, [GenRequest([5, 6], 8, 1.0, seed=3)], pad_id=0)
    t2 = generate(m1, [GenRequest([5, 6], 8, 1.0, seed=3)], pad_id=0)
    assert t1 == t2  # sampling is seeded per request


def test_tokenizer_round_trips_and_has_the_configured_vocab() -> None:
    from pyctl.service.tokenizer import ServiceTokenizer

    tok = ServiceTokenizer(400)
    assert tok.vocab_size == 400
    ids = tok.encode("Hello, wörld 42")
    assert tok.decode(ids) == "Hello, wörld 42"
    assert tok.encode("") == [tok.bos_id]


def test_config_check_names_the_option() -> None:
    with pytest.raises(ValueError, match="--device"):
        ServiceConfig(device="tpu").check()
    with pytest.raises(ValueError, match="--heads"):
        ServiceConfig(d_model=64, n_heads=5).check()
    assert ServiceConfig().check().bytes_per_token == 64 * 4 * 2 * 4


# ---- devices -------------------------------------------------------------------


def test_torch_cuda_errors_are_classified() -> None:
    import torch

    from pyctl.service.device import classify_torch_cuda

    oom = classify_torch_cuda(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried ..."))
    assert oom is not None and oom.code == "CUDA_ERROR_OUT_OF_MEMORY"
    ill = classify_torch_cuda(
        RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors")
    )
    assert ill is not None and ill.code == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert classify_torch_cuda(ValueError("CUDA")) is None
    assert classify_torch_cuda(RuntimeError("shape mismatch")) is None


@pytest.mark.skipif(not paths.DOUBLE_LIBCUDA.exists(), reason="run `make build` (the double)")
def test_double_backend_runs_a_batch_and_reports_real_oom() -> None:
    """The libcuda TEST DOUBLE's pool (1 GiB) really runs out for a 2 GiB batch."""
    from pyctl.service.device import DeviceError, DoubleBackend

    steps: list[int] = []
    out: dict[str, object] = {}

    def in_one_thread() -> None:  # the double's context is per thread, as in CUDA
        be = DoubleBackend(bytes_per_token=1 << 20)
        be.open()
        out["ok"] = be.run_batch(lambda hook: [hook(i) or steps.append(i) for i in range(3)], 8)
        try:
            be.run_batch(lambda hook: None, 2048)
        except DeviceError as e:
            out["err"] = (e.code, e.call)
        out["after"] = be.run_batch(lambda hook: "fine", 8)  # the pool is intact
        be.close()

    t = threading.Thread(target=in_one_thread)
    t.start()
    t.join(30)
    assert steps == [0, 1, 2] and out["after"] == "fine"
    assert out["err"] == ("CUDA_ERROR_OUT_OF_MEMORY", "cuMemAlloc_v2")


def test_service_command_has_help_and_registers_in_a_group() -> None:
    import click
    from click.testing import CliRunner

    from pyctl.cli.service import service

    group = click.Group("gpufault")
    group.add_command(service)  # what pyctl/cli.py does to offer `gpufault service`
    res = CliRunner().invoke(group, ["service", "--help"])
    assert res.exit_code == 0, res.output
    assert "Examples:" in res.output and "--device" in res.output
    assert service.help and service.help.strip()
    bad = CliRunner().invoke(group, ["service", "--batch-wait", "soon"])
    assert bad.exit_code == 2 and "--batch-wait" in bad.output
