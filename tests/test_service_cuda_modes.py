"""The service's --cuda-mode graph / managed on the libcuda TEST DOUBLE, in-process.

Every failure here is a real failed call of the double (a destroyed graph
exec, a graph over freed memory, a prefetch past the allocation, a pool too
small), not a mock: the backend must tell non-sticky ones (graph: eager
fallback; prefetch: ignored) from sticky ones (a device error, then a new
context). The double keeps the current context per thread, as CUDA does, so
each scenario runs in one thread of its own.
"""

from __future__ import annotations

import ctypes as C
import threading
from collections.abc import Callable
from typing import Any

import pytest

from pyctl import paths
from pyctl.service.config import ServiceConfig

double = pytest.mark.skipif(
    not paths.DOUBLE_LIBCUDA.exists(), reason="run `make build` (the double)"
)


def in_thread(fn: Callable[[], Any]) -> Any:
    """fn() in a fresh thread (one double context), its result or its exception."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["v"] = fn()
        except BaseException as e:  # handed to the test thread
            out["e"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the scenario hung"
    if "e" in out:
        raise out["e"]
    return out["v"]


def backend(mode: str, events: list[tuple[str, str]], bytes_per_token: int = 2048) -> Any:
    from pyctl.service.device import DoubleBackend

    be = DoubleBackend(bytes_per_token, mode=mode, static_bytes=64 * 1024)
    be.on_event = lambda ev, code: events.append((ev, code))
    be.open()
    return be


def batch(steps: int) -> Callable[[Any], list[int]]:
    """A batch's decode: the step hook per token, as generate() calls it."""

    def fn(hook: Any) -> list[int]:
        for i in range(steps):
            hook(i)
        return list(range(steps))

    return fn


def first_word(be: Any) -> int:
    """The first u32 of graph mode's static buffer, read back from the double."""
    lib = be.drv.lib
    lib.cuMemcpyDtoH_v2.argtypes = [C.c_void_p, C.c_uint64, C.c_size_t]
    v = C.c_uint32()
    assert lib.cuMemcpyDtoH_v2(C.byref(v), be._graph.dptr, 4) == 0
    return v.value


def test_config_refuses_cuda_modes_it_cannot_run() -> None:
    from click.testing import CliRunner

    from pyctl.cli.service import service

    with pytest.raises(ValueError, match="--cuda-mode warp: choose one of eager, graph, managed"):
        ServiceConfig(device="cpu-double", cuda_mode="warp").check()
    with pytest.raises(ValueError, match="--cuda-mode graph needs --device cpu-double"):
        ServiceConfig(device="cpu", cuda_mode="graph").check()
    with pytest.raises(ValueError, match="torch has no managed-memory allocator"):
        ServiceConfig(device="cuda", cuda_mode="managed").check()
    with pytest.raises(ValueError, match="--ranks 1 only"):
        ServiceConfig(device="cpu-double", cuda_mode="graph", ranks=2).check()
    for ok in (("cpu-double", "graph"), ("cpu-double", "managed"), ("cuda", "graph")):
        assert ServiceConfig(device=ok[0], cuda_mode=ok[1]).check().cuda_mode == ok[1]
    bad = CliRunner().invoke(service, ["--device", "cpu", "--cuda-mode", "graph"])
    assert bad.exit_code == 2 and "--cuda-mode graph needs --device" in bad.output, bad.output


@double
def test_graph_mode_replays_one_captured_graph_per_token() -> None:
    def run() -> tuple[list[int], list[tuple[str, str]], int, int]:
        ev: list[tuple[str, str]] = []
        be = backend("graph", ev)
        out = be.run_batch(batch(3), 10)
        exe = be._graph.exe
        be.run_batch(batch(2), 10)
        same = int(be._graph.exe == exe)  # captured once, not per batch
        word = first_word(be)
        be.close()
        return out, ev, same, word

    out, ev, same, word = in_thread(run)
    assert out == [0, 1, 2] and ev == [("graph_replay", "")] * 5 and same == 1
    assert word == 1  # the replayed graph's fill (captured with value 1) really ran


@double
def test_a_failed_replay_finishes_the_batch_eagerly_and_the_next_batch_recaptures() -> None:
    def run() -> tuple[list[int], list[tuple[str, str]], int, list[tuple[str, str]]]:
        ev: list[tuple[str, str]] = []
        be = backend("graph", ev)
        be.run_batch(batch(1), 10)
        # The exec dies behind the backend's back: cuGraphLaunch really fails.
        be.drv.lib.cuGraphExecDestroy(be._graph.exe)
        ev.clear()
        out = be.run_batch(batch(3), 10)
        word = first_word(be)  # eager launches fill with the step number
        after: list[tuple[str, str]] = []
        be.on_event = lambda e, c: after.append((e, c))
        be.run_batch(batch(2), 10)
        be.close()
        return out, ev, word, after

    out, ev, word, after = in_thread(run)
    assert out == [0, 1, 2]
    assert ev == [("graph_fallback", "CUDA_ERROR_INVALID_VALUE")], ev  # one per batch
    assert word == 2  # steps 0..2 ran as eager gf_fill launches
    assert after == [("graph_replay", "")] * 2  # a fresh capture replays again


@double
def test_a_sticky_replay_error_is_a_device_error_and_a_new_context_recaptures() -> None:
    from pyctl.service.device import DeviceError

    def run() -> tuple[str, str, list[tuple[str, str]], int]:
        ev: list[tuple[str, str]] = []
        be = backend("graph", ev)
        be.run_batch(batch(1), 10)
        gen = be.drv.generation
        be.drv.free(be._graph.dptr)  # the graph now writes freed memory: illegal address
        try:
            be.run_batch(batch(2), 10)
            raise AssertionError("no device error")
        except DeviceError as e:
            code, call = e.code, e.call
        ev.clear()
        be.run_batch(batch(2), 10)
        regen = be.drv.generation - gen
        be.close()
        return code, call, ev, regen

    code, call, ev, regen = in_thread(run)
    assert (code, call) == ("CUDA_ERROR_ILLEGAL_ADDRESS", "cuStreamSynchronize")
    assert regen == 1 and ev == [("graph_replay", "")] * 2  # new context, new graph


@double
def test_managed_mode_ignores_a_failed_prefetch_and_fails_on_a_failed_allocation() -> None:
    from pyctl.service.device import DeviceError

    def run() -> tuple[list[int], list[int], list[tuple[str, str]], tuple[str, str]]:
        ev: list[tuple[str, str]] = []
        be = backend("managed", ev, bytes_per_token=1 << 20)
        ok = be.run_batch(batch(2), 8)
        assert ev == []  # a good prefetch reports nothing
        real = be.drv.prefetch
        # Past the end of the managed allocation: the double's prefetch refuses it.
        be.drv.prefetch = lambda d, n: real(d, n + (1 << 30))
        still = be.run_batch(batch(2), 8)
        be.drv.prefetch = real
        try:
            be.run_batch(batch(1), 2048)  # 2 GiB of managed memory: the 1 GiB pool is short
            raise AssertionError("no device error")
        except DeviceError as e:
            err = (e.code, e.call)
        be.close()
        return ok, still, ev, err

    ok, still, ev, err = in_thread(run)
    assert ok == [0, 1] and still == [0, 1]
    assert ev == [("prefetch_failed", "CUDA_ERROR_INVALID_VALUE")]
    assert err == ("CUDA_ERROR_OUT_OF_MEMORY", "cuMemAllocManaged")


@double
def test_service_graph_mode_counts_replays_and_a_fallback_without_failing_a_request() -> None:
    """The whole batch path: a failing cuGraphLaunch (a NULL exec, refused by
    the double) on the 6th replay; the request is answered by the primary
    model, the fallback is counted, no device error reaches the breaker."""
    from prometheus_client.parser import text_string_to_metric_families

    from pyctl.service.app import Service

    svc = Service(ServiceConfig(device="cpu-double", cuda_mode="graph", port=0, batch_wait_ms=0.0))
    svc.start()
    try:

        def metric(name: str, **labels: str) -> float:
            fams = text_string_to_metric_families(svc.metrics.render().decode())
            return sum(
                s.value
                for f in fams
                for s in f.samples
                if s.name == name and labels.items() <= s.labels.items()
            )

        calls = [0]
        drv = svc.backend.drv  # type: ignore[attr-defined]
        real = drv.graph_launch

        def sixth_fails(exe: int) -> None:
            calls[0] += 1
            real(0 if calls[0] == 6 else exe)

        drv.graph_launch = sixth_fails
        bodies = [svc.complete({"prompt": "hello world", "max_tokens": 4}) for _ in range(3)]
        assert [b.status for b in bodies] == [200] * 3
        assert not any(b.body["degraded"] for b in bodies)
        assert calls[0] == 4 + 2 + 4  # request 2 replayed twice, then ran eager
        assert metric("gf_service_graph_replays_total") == 9
        assert metric("gf_service_graph_fallbacks_total", code="CUDA_ERROR_INVALID_VALUE") == 1
        assert metric("gf_service_errors_total", kind="device") == 0
        assert svc.health()[1]["cuda_mode"] == "graph" and svc.breaker.state == "closed"
    finally:
        svc.stop()


def test_graph_modes_static_shape_gives_the_eager_logits() -> None:
    """--device cuda --cuda-mode graph runs the model at max_batch x
    max_context with each step left-padded into it (pad_into): on the CPU
    the rows' logits equal the eager forward's, so the answers do not change."""
    import torch

    from pyctl.service.device import pad_into
    from pyctl.service.model import build_model

    m = build_model(vocab_size=300, d_model=32, n_heads=4, n_layers=2, max_context=32, seed=1)
    ids = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])
    valid = torch.tensor([[False, True, True, True], [True] * 4])
    with torch.inference_mode():
        big_ids = torch.full((4, 32), 99, dtype=torch.long)  # stale values: overwritten
        big_valid = torch.ones(4, 32, dtype=torch.bool)
        assert pad_into(big_ids, big_valid, ids, valid) == 2
        assert int(big_valid.sum()) == 7 and int(big_ids[2:].abs().sum()) == 0
        eager, static = m(ids, valid), m(big_ids, big_valid)[:2]
    assert torch.allclose(eager, static, atol=1e-5), (eager - static).abs().max()
