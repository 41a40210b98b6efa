"""deploy/: the agent's systemd unit and Kubernetes DaemonSet. The manifest
is validated offline against the Kubernetes schemas (kubernetes-validate,
strict: an unknown field fails); both start `gpufault agent serve` with
options the command really has."""

from __future__ import annotations

import copy
import shlex
from pathlib import Path

import pytest
import yaml

from pyctl.cli.agent import agent

kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (dev)")

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
MANIFEST = DEPLOY / "kubernetes" / "gpufault-agent.yaml"
UNIT = DEPLOY / "systemd" / "gpufault-agent.service"


def _daemonset() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def _serve_parses(args: list[str]) -> None:
    serve = agent.commands["serve"]
    ctx = serve.make_context("serve", list(args), resilient_parsing=True)
    assert ctx.params["listen"] and ctx.params["cert"] and ctx.params["token_file"]


def test_the_daemonset_validates_and_has_what_the_agent_needs() -> None:
    ds = _daemonset()
    kv.validate(ds, kv.latest_version(), strict=True)
    spec = ds["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert spec["hostPID"] is True and c["securityContext"]["privileged"] is True
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/sys/kernel/btf", "/sys/fs/bpf", "/sys/kernel/tracing", "/sys/kernel/debug",
            "/run/gpufault", "/etc/gpufault", "/etc/machine-id"} <= mounts  # fmt: skip
    assert "agent" in c["readinessProbe"]["exec"]["command"]
    assert c["resources"]["limits"]["memory"] and c["resources"]["requests"]["cpu"]
    assert spec["nodeSelector"] and spec["tolerations"]
    assert c["command"] == ["gpufault", "agent", "serve"]
    _serve_parses(c["args"])


def test_the_validation_can_fail() -> None:
    ds = _daemonset()
    bad = copy.deepcopy(ds)
    bad["spec"]["template"]["spec"]["containers"][0]["securityContext"]["privileged"] = "yes"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, kv.latest_version(), strict=True)
    bad = copy.deepcopy(ds)
    bad["spec"]["template"]["spec"]["hostPid"] = True  # misspelt: strict refuses it
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, kv.latest_version(), strict=True)


def test_the_systemd_unit_runs_the_agent_with_real_options() -> None:
    text = UNIT.read_text().replace("\\\n", " ")
    (line,) = [ln for ln in text.splitlines() if ln.startswith("ExecStart=")]
    argv = shlex.split(line.removeprefix("ExecStart="))
    assert argv[:4] == ["/usr/bin/env", "gpufault", "agent", "serve"]
    _serve_parses(argv[4:])
    assert "RuntimeDirectoryMode=0700" in text and "KillSignal=SIGTERM" in text
