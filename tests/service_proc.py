"""The reference inference service as a test's subprocess, and a tiny HTTP client.

Readiness comes from the service's own ready line on stderr ("serving on
http://HOST:PORT ..."), never from sleeping; the rest of stderr is drained
by a thread so the service can never block on a full pipe.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parent.parent
READY = re.compile(r"serving on (http://\S+)")


class ServiceProc:
    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        start_timeout: float = 90.0,
        prefix: tuple[str, ...] = (),  # e.g. ("ip", "netns", "exec", NS): the command's wrapper
    ) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "pyctl.service", "--port", "0", *args],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.pid = self.proc.pid
        self.lines: list[str] = []
        self.url = ""
        # The reader thread finds the ready line, then keeps draining.
        self._ready = threading.Event()
        self._line = threading.Condition()  # notified at each line read
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(start_timeout) or not self.url:
            self.close()
            raise AssertionError("service did not get ready:\n" + "".join(self.lines))
        u = urlsplit(self.url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for ln in self.proc.stderr:
            with self._line:
                self.lines.append(ln)
                self._line.notify_all()
            m = READY.search(ln)
            if m and not self.url:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()  # exited before (or after) being ready
        with self._line:
            self._line.notify_all()

    def wait_line(self, pattern: str, timeout: float = 10.0) -> str:
        """The log so far once a line matches `pattern` (a regex), or at the
        timeout or the service's end: the reader thread takes lines after
        the service wrote them (a reply can come before its log line)."""
        rx = re.compile(pattern)
        with self._line:
            self._line.wait_for(
                lambda: any(rx.search(ln) for ln in self.lines) or not self._reader.is_alive(),
                timeout,
            )
            return "".join(self.lines)

    def stderr(self) -> str:
        return "".join(self.lines)

    def close(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)
        return self.proc.returncode

    # ---- HTTP -------------------------------------------------------------------
    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        timeout: float = 60.0,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        c = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            h = {"Content-Type": "application/json"} if body is not None else {}
            c.request(method, path, body=body, headers={**h, **(headers or {})})
            r = c.getresponse()
            return r.status, dict(r.getheaders()), r.read()
        finally:
            c.close()

    def complete(self, prompt: Any = "hello world", max_tokens: Any = 4, **kw: Any):
        body = {"prompt": prompt, "max_tokens": max_tokens, **kw}
        st, _h, raw = self.request("POST", "/v1/completions", json.dumps(body).encode())
        return st, json.loads(raw)

    def timed_complete(self, **kw: Any) -> tuple[float, int, dict[str, Any]]:
        t = time.monotonic()
        st, body = self.complete(**kw)
        return time.monotonic() - t, st, body

    def health(self) -> tuple[int, dict[str, Any]]:
        st, _h, raw = self.request("GET", "/health")
        return st, json.loads(raw)

    def metrics(self) -> str:
        st, _h, raw = self.request("GET", "/metrics")
        assert st == 200
        return raw.decode()

    def metric_samples(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """{(sample name, sorted labels): value} via prometheus_client's parser."""
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for fam in text_string_to_metric_families(self.metrics()):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out


def sample(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    total, found = 0.0, False
    for (n, lab), v in samples.items():
        d = dict(lab)
        if n == name and all(d.get(k) == val for k, val in labels.items()):
            total += v
            found = True
    assert found, f"no sample {name}{labels}"
    return total


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))]
