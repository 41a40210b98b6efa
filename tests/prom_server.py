"""A real Prometheus server (Debian's `prometheus` package) as a test's
subprocess: its own config, rules and data directory under the test's
tmp_path, listening on 127.0.0.1 on a free port, ready once `/-/ready`
answers 200, stopped (SIGTERM, then SIGKILL) by close().

Prometheus takes no port 0: a free port is picked by binding one and
letting it go; if another process takes it in between, the server exits at
once and start is tried again on another port.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from pyctl.observe.prometheus_files import prometheus_yaml

PROMETHEUS = shutil.which("prometheus")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PromServer:
    def __init__(
        self,
        workdir: Path,
        *,
        service: Sequence[str] = (),
        gpufault: Sequence[str] = (),
        rules: str | None = None,
        interval: str = "1s",
        start_timeout: float = 60.0,
    ) -> None:
        assert PROMETHEUS, "prometheus is not installed (tools/setup-deps.sh)"
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        rule_files: list[str] = []
        if rules is not None:
            (self.dir / "rules.yml").write_text(rules)
            rule_files = ["rules.yml"]
        (self.dir / "prometheus.yml").write_text(
            prometheus_yaml(
                service=service or ["127.0.0.1:9"],
                gpufault=gpufault or ["127.0.0.1:9"],
                rule_files=rule_files,
                scrape_interval=interval,
                evaluation_interval=interval,
            )
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = self.dir / "prometheus.log"
        for _attempt in range(3):
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            if self._start(start_timeout):
                return
        raise AssertionError("prometheus did not get ready:\n" + self.log.read_text()[-3000:])

    def _start(self, timeout: float) -> bool:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={self.dir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.dir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--web.enable-lifecycle",
                    "--log.level=warn",
                ],
                cwd=self.dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False  # the port was taken, or a bad config: see the log
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(0.1)  # polling an outside server's readiness endpoint
        self.close()
        return False

    def wait_target_up(self, job: str, timeout: float = 30.0) -> None:
        """Until Prometheus has scraped `job` successfully (up == 1)."""
        from pyctl.observe.alerts import query

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(v == 1.0 for _m, v in query(self.url, f'up{{job="{job}"}}')):
                return
            time.sleep(0.2)
        raise AssertionError(f"prometheus never scraped job {job}:\n" + self.log.read_text())

    def close(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
