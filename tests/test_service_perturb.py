"""Class 4 bit flips armed from outside: pyctl/service/perturb.py's
PerturbControl on the real TinyCausalLM, and /admin/perturb on a real
service process (tests/service_proc.py; ready line, never a sleep)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch==2.13.0")

from service_proc import ServiceProc  # noqa: E402

from pyctl.service import perturb as P  # noqa: E402
from pyctl.service.model import TinyCausalLM, build_model  # noqa: E402

# The service's defaults (pyctl/service/config.py), so names match a real primary.
MODEL = {"vocab_size": 1000, "d_model": 64, "n_heads": 4, "n_layers": 2, "max_context": 256}
# exp:4 of fp16 is its top exponent bit: a flipped value turns huge or inf,
# so a handful of flips is sure to move the logits.
LOUD = "blocks.*@exp:4@1e-2@fp16"
# A sign flip keeps values finite: outputs of two runs compare exactly.
QUIET = "blocks.*@sign@1e-2"


@pytest.fixture(scope="module")
def model() -> TinyCausalLM:
    return build_model(seed=1234, **MODEL)


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.arange(1, 17).reshape(1, 16)
    return ids, torch.ones_like(ids, dtype=torch.bool)


def forward(m: TinyCausalLM, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return m(*batch)


def control(m: TinyCausalLM) -> P.PerturbControl:
    c = P.PerturbControl()
    c.bind(m)
    return c


def hooks_left(m: TinyCausalLM) -> int:
    # around() must detach: a hook left behind would keep flipping after the end.
    return sum(len(mod._forward_hooks) for mod in m.modules())


def armed_once(
    m: TinyCausalLM, batch: tuple[torch.Tensor, torch.Tensor], rule: str, seed: int
) -> tuple[torch.Tensor, dict[str, Any]]:
    c = control(m)
    c.arm({"rules": [rule], "duration_s": 60, "seed": seed})
    with c.around(m):
        out = forward(m, batch)
    rep = c.status()
    assert rep is not None
    return out, rep


class Clock:
    """A monotonic clock the test moves: the deadline without waiting for it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    # Only the module's view of `time`: the rest of the process keeps the real clock.
    monkeypatch.setattr(P, "time", SimpleNamespace(monotonic=c.monotonic, time=time.time))
    return c


# ---- PerturbControl ---------------------------------------------------------------


def test_not_armed_flips_nothing(model: TinyCausalLM, batch: Any) -> None:
    c = control(model)
    assert c.status() is None and c.disarm() is None
    base = forward(model, batch)
    with c.around(model):
        assert hooks_left(model) == 0
        out = forward(model, batch)
    assert torch.equal(out, base)


def test_armed_counts_bits_per_layer_and_detaches(model: TinyCausalLM, batch: Any) -> None:
    base = forward(model, batch)
    c = control(model)
    rep = c.arm({"rules": [LOUD], "duration_s": 60, "seed": 3})
    assert rep["active"] and rep["bits_flipped"] == 0 and rep["rules"] == [LOUD]
    with c.around(model):
        assert hooks_left(model) > 0
        out = forward(model, batch)
    assert hooks_left(model) == 0
    assert not torch.equal(out, base)
    st = c.status()
    assert st is not None and st["active"] and st["batches"] == 1
    assert st["bits_flipped"] > 0 and st["elements"] > 0
    names = set(st["layers"])
    assert names and all(n.startswith("blocks.") for n in names), names
    assert st["bits_flipped"] == sum(v["bits"] for v in st["layers"].values())
    # A DELETE ends it: the next batch is the unperturbed model again.
    end = c.disarm()
    assert end is not None and not end["active"] and end["end_reason"] == "deleted"
    assert end["bits_flipped"] == st["bits_flipped"]
    with c.around(model):
        again = forward(model, batch)
    assert torch.equal(again, base)
    assert c.status()["batches"] == 1  # type: ignore[index]


def test_the_same_seed_gives_the_same_flips(model: TinyCausalLM, batch: Any) -> None:
    base = forward(model, batch)
    a, ra = armed_once(model, batch, QUIET, seed=7)
    b, rb = armed_once(model, batch, QUIET, seed=7)
    assert not torch.equal(a, base), "the rule flipped nothing that shows"
    assert torch.equal(a, b)
    assert ra["layers"] == rb["layers"]
    # ...and the seed matters: otherwise the equality above proves nothing.
    c, _ = armed_once(model, batch, QUIET, seed=8)
    assert not torch.equal(a, c)


def test_the_deadline_ends_it_without_a_delete(
    model: TinyCausalLM, batch: Any, clock: Clock
) -> None:
    base = forward(model, batch)
    c = control(model)
    c.arm({"rules": [LOUD], "duration_s": 5, "seed": 1})
    clock.now += 4.999
    st = c.status()
    assert st is not None and st["active"] and st["end_reason"] is None
    clock.now += 0.001  # exactly at the deadline: over
    st = c.status()
    assert st is not None and not st["active"] and st["end_reason"] == "deadline"
    with c.around(model):
        out = forward(model, batch)
    assert torch.equal(out, base)
    st = c.status()
    assert st is not None and st["batches"] == 0 and st["bits_flipped"] == 0
    # A DELETE after the deadline keeps the reason it ended for.
    end = c.disarm()
    assert end is not None and end["end_reason"] == "deadline"


def test_a_batch_past_the_deadline_is_not_perturbed_even_unread(
    model: TinyCausalLM, batch: Any, clock: Clock
) -> None:
    # No status() in between: the worker's own check must end it.
    base = forward(model, batch)
    c = control(model)
    c.arm({"rules": [LOUD], "duration_s": 1, "seed": 1})
    clock.now += 2
    with c.around(model):
        out = forward(model, batch)
    assert torch.equal(out, base)


def test_one_at_a_time_until_deleted_or_expired(model: TinyCausalLM, clock: Clock) -> None:
    c = control(model)
    first = c.arm({"rules": [LOUD], "duration_s": 5})
    with pytest.raises(P.PerturbError, match=f"{first['id']} is active: DELETE it first"):
        c.arm({"rules": [LOUD], "duration_s": 5})
    c.disarm()
    second = c.arm({"rules": [LOUD], "duration_s": 5})
    assert second["id"] != first["id"] and second["active"]
    clock.now += 5
    third = c.arm({"rules": [QUIET], "duration_s": 1, "seed": 2})  # the expired one is no bar
    assert third["rules"] == [QUIET] and third["seed"] == 2


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ([LOUD], "expected a JSON object"),
        ({"rules": [LOUD], "duration_s": 5, "colour": 1}, "unknown field(s) ['colour']"),
        ({"rules": LOUD, "duration_s": 5}, "rules: give a list"),
        ({"rules": [], "duration_s": 5}, "rules: give a list"),
        ({"rules": ["blocks.*@exp:9@1e-2@fp16"], "duration_s": 5}, "rules: "),
        ({"rules": ["blocks.*@sign"], "duration_s": 5}, "PATTERN@BITS@RATE"),
        ({"rules": ["blocks.*@sign@2"], "duration_s": 5}, "not a probability"),
        ({"rules": ["decoder.*@sign@1e-3"], "duration_s": 5}, "'decoder.*' names no nn.Linear"),
        ({"rules": [LOUD]}, "duration_s: give the seconds"),
        ({"rules": [LOUD], "duration_s": "5"}, "duration_s: give the seconds"),
        ({"rules": [LOUD], "duration_s": True}, "duration_s: give the seconds"),
        ({"rules": [LOUD], "duration_s": 0}, "0 < duration_s <= 600"),
        ({"rules": [LOUD], "duration_s": 600.5}, "0 < duration_s <= 600"),
        ({"rules": [LOUD], "duration_s": 5, "seed": "7"}, "seed: an integer"),
    ],
)
def test_bad_arms_name_the_field_and_arm_nothing(
    model: TinyCausalLM, spec: Any, needle: str
) -> None:
    c = control(model)
    with pytest.raises(P.PerturbError) as ei:
        c.arm(spec)
    assert needle in str(ei.value) and "\n" not in str(ei.value), str(ei.value)
    assert c.status() is None


def test_a_bad_bit_name_without_a_dtype_is_refused_at_arm(model: TinyCausalLM) -> None:
    # Once armed with 200 and then failed every batch with HTTP 500.
    c = control(model)
    with pytest.raises(P.PerturbError, match="rules: "):
        c.arm({"rules": ["blocks.*@nonsense@1e-2"], "duration_s": 5})


def test_a_name_that_matches_no_layer_lists_real_ones(model: TinyCausalLM) -> None:
    with pytest.raises(P.PerturbError) as ei:
        control(model).arm({"rules": ["head@sign@1e-3"], "duration_s": 5})
    assert "blocks.0.qkv" in str(ei.value)
    # "matmul" names no module and is not refused for it.
    assert control(model).arm({"rules": ["matmul@sign@1e-3"], "duration_s": 5})["active"]


# ---- /admin/perturb on a real service -----------------------------------------------

PROMPT = "The quick brown fox jumps over"


def greedy(s: ServiceProc) -> str:
    st, body = s.complete(PROMPT, 8, temperature=0)
    assert st == 200, body
    assert body["degraded"] is False, body  # the primary model answered, not the fallback
    return body["choices"][0]["text"]


# The admin token the services of these tests are started with.
TOKEN = "test-admin-token-0123456789abcdef"


def admin(
    s: ServiceProc, method: str, body: Any = None, token: str | None = TOKEN
) -> tuple[int, dict[str, Any]]:
    raw = None if body is None else json.dumps(body).encode()
    auth = {"Authorization": f"Bearer {token}"} if token is not None else {}
    st, _h, out = s.request(method, "/admin/perturb", raw, headers=auth)
    return st, json.loads(out)


@pytest.fixture(scope="module")
def svc() -> Iterator[ServiceProc]:
    s = ServiceProc(
        "--perturb-control", "--max-tokens-limit", "16", env={"GPUFAULT_ADMIN_TOKEN": TOKEN}
    )
    yield s
    assert s.close() == 0, s.stderr()


def test_armed_flips_change_the_greedy_completion_and_delete_restores_it(
    svc: ServiceProc,
) -> None:
    assert admin(svc, "GET") == (
        404,
        {"error": {"type": "not_found", "message": "nothing was armed: POST /admin/perturb first"}},
    )
    clean = greedy(svc)
    assert greedy(svc) == clean  # greedy is deterministic, or the comparison below is noise
    st, rep = admin(svc, "POST", {"rules": [LOUD], "duration_s": 120, "seed": 5})
    assert st == 200 and rep["active"] and rep["rules"] == [LOUD], rep
    try:
        assert greedy(svc) != clean
        st, busy = admin(svc, "POST", {"rules": [QUIET], "duration_s": 5})
        assert st == 409 and f"{rep['id']} is active" in busy["error"]["message"], busy
        st, now = admin(svc, "GET")
        assert st == 200 and now["id"] == rep["id"] and now["active"] and now["batches"] >= 1
    finally:
        st, end = admin(svc, "DELETE")
    assert st == 200 and end["id"] == rep["id"], end
    assert not end["active"] and end["end_reason"] == "deleted"
    assert end["bits_flipped"] > 0
    assert end["layers"] and all(n.startswith("blocks.") for n in end["layers"]), end["layers"]
    assert greedy(svc) == clean
    # The report stays readable after the end, with no new batches counted.
    st, after = admin(svc, "GET")
    assert st == 200 and after["batches"] == end["batches"] and not after["active"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"rules": ["blocks.*@exp:9@1e-2@fp16"], "duration_s": 5}, "rules: "),
        ({"rules": ["nowhere.*@sign@1e-3"], "duration_s": 5}, "names no nn.Linear"),
        ({"rules": [LOUD], "duration_s": 0}, "0 < duration_s"),
        ({"rules": [LOUD], "duration_s": 9999}, "0 < duration_s"),
        ({"rules": [LOUD]}, "duration_s"),
    ],
)
def test_bad_arms_over_http_are_400(svc: ServiceProc, body: Any, needle: str) -> None:
    st, out = admin(svc, "POST", body)
    assert st == 400 and out["error"]["type"] == "invalid_request_error", out
    assert needle in out["error"]["message"], out


def test_bad_json_over_http_is_400(svc: ServiceProc) -> None:
    st, _h, raw = svc.request("POST", "/admin/perturb", b"{nope")
    assert st == 400 and "invalid JSON" in json.loads(raw)["error"]["message"]


def test_without_the_flag_the_route_is_closed() -> None:
    s = ServiceProc()
    try:
        for method, body in (
            ("GET", None),
            ("POST", {"rules": [LOUD], "duration_s": 5}),
            ("DELETE", None),
        ):
            st, out = admin(s, method, body)
            assert st == 404, (method, out)
            assert "--perturb-control" in out["error"]["message"], (method, out)
        # ...and the model answers as it does without one: nothing was armed.
        assert s.complete(PROMPT, 4, temperature=0)[0] == 200
    finally:
        assert s.close() == 0, s.stderr()


# ---- who may arm: the admin token (issue 25, item 5) -------------------------------


def test_admin_needs_the_token_and_each_arm_is_logged_with_its_peer(svc: ServiceProc) -> None:
    """No token and a wrong one: 401 for every method, nothing armed; the
    right one: 200, and the service's log names who armed what."""
    arm = {"rules": [QUIET], "duration_s": 5, "seed": 3}
    for token in (None, "wrong-token-0123456789abcdef", TOKEN[:-1]):
        for method, body in (("POST", arm), ("GET", None), ("DELETE", None)):
            st, out = admin(svc, method, body, token=token)
            assert st == 401 and out["error"]["type"] == "unauthorized", (token, method, out)
            assert "Authorization: Bearer" in out["error"]["message"]
    # Nothing was armed by the refused POSTs.
    st, rep = admin(svc, "GET")
    assert st == 404 or not rep["active"], rep
    st, rep = admin(svc, "POST", arm)
    assert st == 200 and rep["active"], rep
    st, end = admin(svc, "DELETE")
    assert st == 200 and end["id"] == rep["id"]
    # The reply may come before the reader thread has the log line.
    log = svc.wait_line(rf"ended perturbation {rep['id']}")
    assert re.search(
        rf"admin: 127\.0\.0\.1:\d+ armed perturbation {rep['id']}: {re.escape(QUIET)} seed 3 "
        r"for 5 s",
        log,
    ), log
    assert re.search(rf"admin: 127\.0\.0\.1:\d+ ended perturbation {rep['id']}", log), log
    assert re.search(r"admin: POST /admin/perturb from 127\.0\.0\.1:\d+ refused", log), log


def _service_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if k != "GPUFAULT_ADMIN_TOKEN"}
    return subprocess.run(
        [sys.executable, "-m", "pyctl", "service", "--port", "0", *args],
        capture_output=True,
        text=True,
        env={**e, **(env or {})},
        timeout=60,
    )


def _one_line(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_perturb_control_without_a_token_does_not_start() -> None:
    line = _one_line(_service_cli("--perturb-control"))
    assert line.startswith("gpufault: ") and "needs an admin token" in line, line
    assert "--admin-token-file" in line and "GPUFAULT_ADMIN_TOKEN" in line, line


def test_a_token_file_others_can_read_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    os.chmod(f, 0o644)
    line = _one_line(_service_cli("--perturb-control", "--admin-token-file", str(f)))
    assert f"--admin-token-file {f}" in line and "chmod 600" in line, line
    link = tmp_path / "link"
    link.symlink_to(f)
    os.chmod(f, 0o600)
    line = _one_line(_service_cli("--perturb-control", "--admin-token-file", str(link)))
    assert f"--admin-token-file {link}" in line, line  # a link is not followed


def test_a_token_file_works(tmp_path: Path) -> None:
    f = tmp_path / "token"
    fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, TOKEN.encode() + b"\n")
    os.close(fd)
    s = ServiceProc("--perturb-control", "--admin-token-file", str(f))
    try:
        assert admin(s, "GET", token=None)[0] == 401
        assert admin(s, "GET")[0] == 404  # authorized: nothing armed yet
    finally:
        assert s.close() == 0, s.stderr()


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_remote_admin_bind_needs_a_second_flag(host: str) -> None:
    env = {"GPUFAULT_ADMIN_TOKEN": TOKEN}
    line = _one_line(_service_cli("--host", host, "--perturb-control", env=env))
    assert line.startswith("gpufault: ") and f"--host {host} with --perturb-control" in line
    assert "--allow-remote-admin" in line, line
