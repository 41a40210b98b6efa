"""Tensor Core bit flips in the primary model, armed from outside (class 4).

`gpufault service --perturb-control` opens `/admin/perturb`: a POST arms
pyctl.hooks.tc_perturb's Perturber on the primary model for a bounded
time, a GET reads what it flipped, a DELETE ends it early and returns the
counts. This is an in-process fault: gpufault's uprobes cannot flip bits
in a GEMM's output on the device, the model's own hooks can (docs/hooks.md).

Why the service and not the caller keeps the clock: the deadline is
checked by the worker before every batch, so the flips end on time even
when the experiment runner that armed them hangs or is killed. Only one
perturbation is armed at a time; a second POST while one runs is refused
(409), so two experiments cannot mix their flips.

Who may: the holder of the admin token (`Authorization: Bearer TOKEN`),
from --admin-token-file (a regular file only root can read) or
GPUFAULT_ADMIN_TOKEN; the control refuses to start without one, since
any local user can reach a loopback port. Every request without the
token is 401; every arm and end is logged with the peer's address.
`gpufault experiment` makes a fresh token for a service it starts.

The worker thread applies it (`around(model)` around each primary batch):
forward hooks and the matmul TorchFunctionMode of the Perturber must be
entered on the thread that runs the model.
"""

from __future__ import annotations

import fnmatch
import hmac
import os
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

MAX_DURATION_S = 600.0  # an arm without an end is refused: the service must not stay corrupt


TOKEN_ENV = "GPUFAULT_ADMIN_TOKEN"


class PerturbError(ValueError):
    """A bad arm request: the message says which field and what to do."""


class AdminTokenError(ValueError):
    """No usable admin token: one line, what and what to do."""


def read_token_file(path: str) -> str:
    """The token in PATH: a regular file (not a link), owned by root (or
    this user) and readable by nobody else, checked on the open file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as e:
        raise AdminTokenError(
            f"--admin-token-file {path}: {e.strerror}: give a file only root can read"
        ) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise AdminTokenError(f"--admin-token-file {path}: not a regular file")
        if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o077:
            raise AdminTokenError(
                f"--admin-token-file {path}: owned by uid {st.st_uid}, mode "
                f"{st.st_mode & 0o777:04o}: make it root's and 0600 (chmod 600)"
            )
        token = f.read(4096).decode("utf-8", "replace").strip()
    if len(token) < 16:
        raise AdminTokenError(f"--admin-token-file {path}: give a token of 16 characters or more")
    return token


def admin_token(token_file: str | None, env: dict[str, str] | None = None) -> str:
    """The token from --admin-token-file, else GPUFAULT_ADMIN_TOKEN;
    AdminTokenError when neither gives one."""
    if token_file:
        return read_token_file(token_file)
    token = (os.environ if env is None else env).get(TOKEN_ENV, "").strip()
    if not token:
        raise AdminTokenError(
            "--perturb-control needs an admin token: pass --admin-token-file PATH "
            f"(a file only root can read) or set {TOKEN_ENV}"
        )
    if len(token) < 16:
        raise AdminTokenError(f"{TOKEN_ENV}: give a token of 16 characters or more")
    return token


@dataclass
class Armed:
    id: str
    rules: list[Any]  # tc_perturb.Rule
    seed: int
    started: float  # time.time()
    deadline: float  # time.monotonic()
    duration_s: float
    perturber: Any  # tc_perturb.Perturber, its generators kept across batches
    batches: int = 0
    ended: float | None = None
    end_reason: str | None = None
    rules_text: list[str] = field(default_factory=list)

    def report(self) -> dict[str, Any]:
        counts = {
            name: {"calls": c.calls, "elements": c.elements, "bits": c.bits}
            for name, c in sorted(list(self.perturber.counts.items()))
        }
        return {
            "id": self.id,
            "rules": self.rules_text,
            "seed": self.seed,
            "started": self.started,
            "duration_s": self.duration_s,
            "active": self.ended is None,
            "ended": self.ended,
            "end_reason": self.end_reason,
            "batches": self.batches,
            "bits_flipped": sum(c["bits"] for c in counts.values()),
            "elements": sum(c["elements"] for c in counts.values()),
            "layers": counts,
        }


def _rules(spec: dict[str, Any]) -> tuple[list[Any], list[str]]:
    # lazy: pyctl.hooks.bitflip imports torch (seconds to import) only where it is used
    from pyctl.hooks.bitflip import BitSpecError

    # lazy: pyctl.hooks.tc_perturb imports torch (seconds to import) only where it is used
    from pyctl.hooks.tc_perturb import parse_rule

    raw = spec.get("rules")
    if not isinstance(raw, list) or not raw or not all(isinstance(r, str) for r in raw):
        raise PerturbError(
            'rules: give a list of PATTERN@BITS@RATE[@DTYPE] strings, e.g. ["blocks.*@sign@1e-3"]'
        )
    try:
        return [parse_rule(r) for r in raw], list(raw)
    except BitSpecError as e:
        raise PerturbError(f"rules: {e}") from None


class PerturbControl:
    """The armed perturbation, shared by the HTTP threads and the worker."""

    def __init__(self, token: str = "", log: Any = None) -> None:
        self._token = token.encode()  # "": in-process use only, HTTP gets 401
        self._log = log or (lambda _msg: None)
        self._lock = threading.Lock()
        self._cur: Armed | None = None
        self._model: Any = None  # checked at arm: a pattern must name a layer

    def deny(self, authorization: str | None, peer: str, method: str) -> str | None:
        """None when `Authorization: Bearer TOKEN` holds the admin token;
        else the 401's message (and a log line naming the peer)."""
        scheme, _, given = (authorization or "").strip().partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self._token)
        if ok and self._token:  # an empty token (never configured) opens nothing
            return None
        why = "no admin token" if not authorization else "a wrong admin token"
        self._log(f"admin: {method} /admin/perturb from {peer} refused ({why})")
        return (
            f"{why}: send Authorization: Bearer TOKEN (the service's --admin-token-file "
            f"or {TOKEN_ENV})"
        )

    def bind(self, model: Any) -> None:
        self._model = model

    def arm(self, spec: Any, peer: str = "in-process") -> dict[str, Any]:
        # lazy: pyctl.hooks.tc_perturb imports torch (seconds to import) only where it is used
        from pyctl.hooks.tc_perturb import Perturber

        if not isinstance(spec, dict):
            raise PerturbError('expected a JSON object {"rules": [...], "duration_s": 5}')
        unknown = set(spec) - {"rules", "duration_s", "seed"}
        if unknown:
            raise PerturbError(f"unknown field(s) {sorted(unknown)}: use rules, duration_s, seed")
        rules, texts = _rules(spec)
        dur = spec.get("duration_s")
        if isinstance(dur, bool) or not isinstance(dur, (int, float)):
            raise PerturbError("duration_s: give the seconds it lasts (a number, at most 600)")
        if not 0 < dur <= MAX_DURATION_S:
            raise PerturbError(f"duration_s {dur}: use 0 < duration_s <= {MAX_DURATION_S:g}")
        seed = spec.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise PerturbError("seed: an integer")
        if self._model is not None:
            self._check_names(rules)
        p = Perturber(rules, seed=seed)
        with self._lock:
            cur = self._cur
            if cur is not None and cur.ended is None and time.monotonic() < cur.deadline:
                raise PerturbError(f"perturbation {cur.id} is active: DELETE it first")
            self._cur = Armed(
                id=uuid.uuid4().hex[:12],
                rules=rules,
                seed=seed,
                started=time.time(),
                deadline=time.monotonic() + float(dur),
                duration_s=float(dur),
                perturber=p,
                rules_text=texts,
            )
            self._log(
                f"admin: {peer} armed perturbation {self._cur.id}: {', '.join(texts)} "
                f"seed {seed} for {float(dur):g} s"
            )
            return self._cur.report()

    def _check_names(self, rules: list[Any]) -> None:
        """A pattern that names no layer flips nothing: say so now, by name
        (not by attaching: the worker may be running the model)."""
        # lazy: torch (seconds to import) only where it is used
        from torch import nn

        # lazy: pyctl.hooks.tc_perturb imports torch (seconds to import) only where it is used
        from pyctl.hooks.tc_perturb import MATMUL

        names = [n for n, m in self._model.named_modules() if isinstance(m, nn.Linear)]
        dtype = next(self._model.parameters()).dtype  # the outputs' own, for rules without one
        for r in rules:
            if r.as_dtype is None:
                # lazy: pyctl.hooks.bitflip imports torch (seconds to import) only where it is used
                from pyctl.hooks.bitflip import BitSpecError, bit_positions

                try:
                    bit_positions(r.bits, dtype)
                except BitSpecError as e:
                    raise PerturbError(f"rules: {e} (the model's outputs are {dtype})") from None
            if r.pattern != MATMUL and not any(fnmatch.fnmatchcase(n, r.pattern) for n in names):
                raise PerturbError(
                    f"rules: {r.pattern!r} names no nn.Linear of the model: use one of "
                    f"{', '.join(names[:6])} (globs allowed), or 'matmul'"
                )

    def _expire(self, cur: Armed) -> None:
        if cur.ended is None and time.monotonic() >= cur.deadline:
            cur.ended, cur.end_reason = time.time(), "deadline"

    def status(self) -> dict[str, Any] | None:
        with self._lock:
            if self._cur is None:
                return None
            self._expire(self._cur)
            return self._cur.report()

    def disarm(self, peer: str = "in-process") -> dict[str, Any] | None:
        with self._lock:
            cur = self._cur
            if cur is None:
                return None
            self._expire(cur)
            if cur.ended is None:
                cur.ended, cur.end_reason = time.time(), "deleted"
                self._log(f"admin: {peer} ended perturbation {cur.id}")
            return cur.report()

    @contextmanager
    def around(self, model: Any) -> Iterator[None]:
        """Flip bits in this batch if a perturbation is armed and not past
        its deadline (the worker thread calls it around a primary batch)."""
        with self._lock:
            cur = self._cur
            if cur is not None:
                self._expire(cur)
            live = cur is not None and cur.ended is None
            if live:
                assert cur is not None
                cur.batches += 1
        if not live:
            yield
            return
        assert cur is not None
        # matmul outputs are named by their order (matmul#N): count per
        # batch, so a long arm does not grow a new name for every call.
        cur.perturber.new_pass()
        cur.perturber.attach(model)
        try:
            yield
        finally:
            cur.perturber.detach()


__all__ = [
    "MAX_DURATION_S",
    "TOKEN_ENV",
    "AdminTokenError",
    "PerturbControl",
    "PerturbError",
    "admin_token",
    "read_token_file",
]
