"""HTTP probes: a request's status and a JSON path or its body (http), a
PromQL instant query (prometheus), one sample of a text exposition such
as the service's /metrics (metric)."""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Callable
from typing import Any, ClassVar
from urllib.parse import urlencode, urlsplit

from pyctl.experiment.probes.base import Value, _Probe, _Table, _url, _verdict
from pyctl.experiment.probes.tolerance import ProbeError


def _http(
    method: str,
    url: str,
    timeout: float,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    """One request on a fresh connection (a probe that reuses one would not
    see a server that stopped accepting)."""
    u = urlsplit(url)
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    if u.hostname is None:  # _url() refuses such a URL; this narrows str | None
        raise ProbeError(f"{url!r} has no host")
    conn = cls(u.hostname, u.port, timeout=timeout)
    try:
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        h = {"Connection": "close", **(headers or {})}
        if body is not None:
            h.setdefault("Content-Type", "application/json")
        conn.request(method, path, body, h)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


_PATH_PART = re.compile(r"\.?([A-Za-z_][\w-]*)|\[(\d+)\]|\[\"([^\"]*)\"\]")


def _json_path(path: str, where: str) -> list[str | int]:
    """'breaker.state', '$.choices[0].text', 'a["b.c"]' -> keys and indexes."""
    p = path[1:] if path.startswith("$") else path
    out: list[str | int] = []
    pos = 0
    while pos < len(p):
        m = _PATH_PART.match(p, pos)
        if not m or (pos == 0 and p.startswith(".") and path[0] != "$"):
            raise ProbeError(
                f'{where}: {path!r} is not a JSON path (use e.g. "breaker.state" or '
                f'"choices[0].text")'
            )
        out.append(m.group(1) or (int(m.group(2)) if m.group(2) else m.group(3)))
        pos = m.end()
    if not out:
        raise ProbeError(f'{where}: empty JSON path (use e.g. "breaker.state")')
    return out


def _walk(doc: Any, parts: list[str | int]) -> tuple[bool, Any]:
    for k in parts:
        if isinstance(k, int) and isinstance(doc, list) and k < len(doc):
            doc = doc[k]
        elif isinstance(k, str) and isinstance(doc, dict) and k in doc:
            doc = doc[k]
        else:
            return False, None
    return True, doc


def _scalar(v: Any) -> Value:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return json.dumps(v, sort_keys=True)


class HttpProbe(_Probe):
    """An HTTP request: status (default 200..299) and, optionally, a JSON
    path's value or the body text against `tolerance`."""

    kind = "http"
    FACT_FIELDS = ("url", "body", "headers")

    def __init__(self, name: str, r: _Table) -> None:
        super().__init__(name, r)
        self.url = _url(r, "url", '"http://127.0.0.1:8000/health"')
        self.method = r.choice("method", ("GET", "POST", "PUT", "DELETE", "HEAD", "PATCH"), "GET")
        body = r.get("body", (str, dict, list), '"{}"', None, facts=True)
        self.body = (
            None
            if body is None
            else body.encode()
            if isinstance(body, str)
            else json.dumps(body).encode()
        )
        self.headers = r.strings("headers", '{Authorization = "Bearer ..."}', facts=True)
        self.status = r.tolerance("status", [200, 299])
        jp = r.get("json_path", (str,), '"breaker.state"', None)
        self.json_path = jp
        self._parts = _json_path(jp, f"{r.where}.json_path") if jp is not None else None
        self.tolerance = r.optional_tolerance("tolerance")
        if self._parts is not None and self.tolerance is None:
            raise ProbeError(
                f'{r.where}: json_path needs a tolerance (add e.g. tolerance = "closed")'
            )

    def _measure(self) -> tuple[bool, Value, str]:
        status, body = _http(self.method, self.url, self.timeout, self.body, self.headers)
        st_ok = self.status.check(status)
        what = f"{self.method} {self.url}: {status}"
        if not st_ok:
            what += f" (want {self.status})"
        if self._parts is not None:
            try:
                doc = json.loads(body)
            except ValueError:
                return False, None, f"{what}, answer is not JSON"
            found, v = _walk(doc, self._parts)
            if not found:
                return False, None, f"{what}, no {self.json_path} in the answer"
            v = _scalar(v)
            tol = self.tolerance
            if tol is None:  # __init__ refuses a json_path without one; this narrows the type
                raise ProbeError(f"{self.where}: json_path needs a tolerance")
            ok = tol.check(v)
            return (
                st_ok and ok,
                v,
                f"{what}, {self.json_path} = {v!r} ({_verdict(ok, tol)})",
            )
        if self.tolerance is not None:
            text = body.decode(errors="replace")
            ok = self.tolerance.check(text)
            short = text[:60] + ("..." if len(text) > 60 else "")
            return st_ok and ok, text, f"{what}, body {short!r} ({_verdict(ok, self.tolerance)})"
        return st_ok, status, what


class PrometheusProbe(_Probe):
    """A PromQL instant query through Prometheus's HTTP API (/api/v1/query):
    a scalar, or a vector of exactly one series, against `tolerance`."""

    kind = "prometheus"
    FACT_FIELDS = ("url", "query")

    def __init__(self, name: str, r: _Table) -> None:
        super().__init__(name, r)
        self.url = _url(r, "url", '"http://127.0.0.1:9090"').rstrip("/")
        self.query = r.get("query", (str,), '"histogram_quantile(0.99, ...)"', facts=True)
        if not self.query.strip():
            raise ProbeError(f"{r.where}.query: empty query (write a PromQL expression)")
        self.tolerance = r.tolerance("tolerance")

    def _measure(self) -> tuple[bool, Value, str]:
        url = f"{self.url}/api/v1/query?{urlencode({'query': self.query})}"
        status, body = _http("GET", url, self.timeout)
        try:
            doc = json.loads(body)
        except ValueError:
            return False, None, f"prometheus {self.url}: HTTP {status}, answer is not JSON"
        if doc.get("status") != "success":
            err = doc.get("error") or f"HTTP {status}"
            return (
                False,
                None,
                f"prometheus query {self.query!r}: {doc.get('errorType', 'error')}: {err}",
            )
        data = doc.get("data") or {}
        rtype = data.get("resultType")
        # Any, as JSON is: a result of the wrong shape raises below, a failed sample.
        result: Any = data.get("result")
        if rtype in ("scalar", "string"):
            v: Value = result[1] if rtype == "string" else float(result[1])
        elif rtype == "vector":
            if len(result) != 1:
                return (
                    False,
                    None,
                    (
                        f"prometheus query {self.query!r} returned {len(result)} series, want 1"
                        " (aggregate in PromQL, e.g. max(...) or sum(...))"
                    ),
                )
            v = float(result[0]["value"][1])
        else:
            return (
                False,
                None,
                f"prometheus query {self.query!r}: a {rtype} result (use an instant query)",
            )
        ok = self.tolerance.check(v)
        return ok, v, f"prometheus {self.query!r} = {v!r} ({_verdict(ok, self.tolerance)})"


class MetricProbe(_Probe):
    """One sample of a Prometheus text exposition (the service's /metrics),
    matched by name and labels; several matches need `aggregate`."""

    kind = "metric"
    FACT_FIELDS = ("url", "metric", "labels")
    AGGREGATES: ClassVar[dict[str, Callable[[list[float]], float]]] = {
        "sum": sum,
        "max": max,
        "min": min,
    }

    def __init__(self, name: str, r: _Table) -> None:
        super().__init__(name, r)
        self.url = _url(r, "url", '"http://127.0.0.1:8000/metrics"')
        self.metric = r.get("name", (str,), '"gf_service_breaker_state"', facts=True)
        self.labels = r.strings("labels", '{kind = "device"}', facts=True) or {}
        self.aggregate = r.choice("aggregate", ("only", *self.AGGREGATES), "only")
        self.tolerance = r.tolerance("tolerance")

    def _measure(self) -> tuple[bool, Value, str]:
        # lazy: keeps prometheus_client (gc, gzip, +41 modules, ~100 ms) off `--help`
        from prometheus_client.parser import text_string_to_metric_families

        status, body = _http("GET", self.url, self.timeout)
        if status != 200:
            return False, None, f"GET {self.url}: {status}"
        vals, names = [], set()
        for fam in text_string_to_metric_families(body.decode()):
            for s in fam.samples:
                names.add(s.name)
                if s.name == self.metric and all(
                    s.labels.get(k) == v for k, v in self.labels.items()
                ):
                    vals.append(float(s.value))
        sel = self.metric + (
            "{" + ",".join(f'{k}="{v}"' for k, v in self.labels.items()) + "}"
            if self.labels
            else ""
        )
        if not vals:
            near = sorted(n for n in names if n.startswith(self.metric.split("_")[0]))[:5]
            hint = f"; names there: {', '.join(near)}" if near else ""
            return False, None, f"{self.url}: no sample {sel}{hint}"
        if len(vals) > 1 and self.aggregate == "only":
            return (
                False,
                None,
                (f'{self.url}: {len(vals)} samples match {sel}: add labels or aggregate = "sum"'),
            )
        v = vals[0] if self.aggregate == "only" else self.AGGREGATES[self.aggregate](vals)
        ok = self.tolerance.check(v)
        return ok, v, f"{sel} = {v:g} ({_verdict(ok, self.tolerance)})"
