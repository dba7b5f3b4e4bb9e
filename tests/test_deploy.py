"""The deployment files (deploy/: the container, its entrypoint, the Kubernetes manifest) say
what docs/scaling.md says: the ports, the health probes, the admin APIs restricted as
`tlaloc serve` restricts them, and the session header the client sends and the balancer hashes
on. Parsed, not run: no Docker or Kubernetes here."""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from triton_tlaloc.cli import build_parser
from triton_tlaloc.frontends.client import SESSION_HEADER
from triton_tlaloc.triton.server import ADMIN_KEY_HEADER, RESTRICTED_APIS

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
PORTS = {"http": 8000, "grpc": 8001, "http-metrics": 8002}


@pytest.fixture(scope="module")
def manifest() -> dict:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "triton-tlaloc.yaml")
                                          .read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert sorted(by_kind) == ["Deployment", "DestinationRule", "Service"] and len(docs) == 3
    return by_kind


def test_the_deployment_names_the_ports_and_the_health_probes(manifest):
    pod = manifest["Deployment"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == PORTS
    probes = {kind: container[f"{kind}Probe"]["httpGet"] for kind in ("startup", "readiness")}
    assert probes["readiness"] == {"path": "/v2/health/ready", "port": "http"}
    assert probes["startup"] == {"path": "/v2/health/ready", "port": "http"}
    # liveness: the live endpoint and every model process (tlaloc check-stubs)
    command = container["livenessProbe"]["exec"]["command"]
    assert command[:2] == ["tlaloc", "check-stubs"]
    args = build_parser().parse_args(command[1:])
    assert args.url == f"127.0.0.1:{PORTS['http']}"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800  # cold compiles
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["metadata"]["labels"] == manifest["Deployment"]["spec"]["selector"][
        "matchLabels"]


def test_the_service_and_the_affinity_rule_route_by_the_session_header(manifest):
    service = manifest["Service"]
    assert service["spec"]["selector"] == manifest["Deployment"]["spec"]["selector"][
        "matchLabels"]
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        name: (port, name) for name, port in PORTS.items()}
    rule = manifest["DestinationRule"]["spec"]
    assert rule["host"] == service["metadata"]["name"]
    assert rule["trafficPolicy"]["loadBalancer"]["consistentHash"] == {
        "httpHeaderName": SESSION_HEADER}
    scaling = (ROOT / "docs" / "scaling.md").read_text()
    assert f"consistentHash.httpHeaderName: {SESSION_HEADER}" in " ".join(scaling.split())


def test_the_image_serves_on_the_three_ports_with_the_admin_apis_restricted():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    froms = re.findall(r"^FROM (\S+)", dockerfile, re.M)
    assert froms == ["nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-py3"]
    assert re.search(r"^EXPOSE 8000 8001 8002$", dockerfile, re.M)
    assert 'ENTRYPOINT ["/usr/local/bin/tlaloc-entrypoint"]' in dockerfile
    assert "COPY deploy/entrypoint.sh /usr/local/bin/tlaloc-entrypoint" in dockerfile
    entrypoint = (DEPLOY / "entrypoint.sh").read_text()
    subprocess.run(["sh", "-n", str(DEPLOY / "entrypoint.sh")], check=True)  # it parses
    rule = re.search(r'^rule="([^"]+)"$', entrypoint, re.M).group(1)
    apis, key = rule.split(":", 1)
    assert sorted(apis.split(",")) == sorted(RESTRICTED_APIS)
    assert key == f"{ADMIN_KEY_HEADER}=${{TLALOC_ADMIN_KEY}}"
    command = " ".join(shlex.split(entrypoint[entrypoint.index("exec tritonserver"):],
                                   comments=True))
    for flag in ("--http-port=8000", "--grpc-port=8001", "--metrics-port=8002",
                 '--http-restricted-api=${rule}', '--grpc-restricted-protocol=${rule}'):
        assert flag in command, flag
    assert "--http-address" not in command  # tritonserver binds every address by default


def test_the_liveness_probe_fails_once_a_model_process_has_died(tmp_path):
    """`tlaloc check-stubs` over a stand-in model process (a Python named as the backend's stub,
    running REPO/toy/1/model.py, a child of this test as a stub is of tritonserver): the first
    run records it, later runs pass while it lives and fail once it is killed."""
    import http.server
    import os
    import signal
    import sys
    import threading

    from triton_tlaloc.cli import main

    class Live(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/v2/health/live" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass
    httpd = http.server.HTTPServer(("127.0.0.1", 0), Live)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    model = tmp_path / "repo" / "toy" / "1" / "model.py"
    model.parent.mkdir(parents=True)
    model.write_text("import time\ntime.sleep(120)\n")
    stub = tmp_path / "triton_python_backend_stub"
    stub.symlink_to(sys.executable)
    proc = subprocess.Popen([str(stub), str(model)])
    url, state = f"127.0.0.1:{httpd.server_port}", tmp_path / "state.json"
    probe = ["check-stubs", "--url", url, "--pid", str(os.getpid()), "--state", str(state)]
    try:
        time.sleep(0.5)
        assert main(probe) == 0 and "toy" in state.read_text()  # recorded
        assert main(probe) == 0  # alive
        os.kill(proc.pid, signal.SIGKILL)
        time.sleep(0.5)  # a zombie now: nobody has reaped it
        assert main(probe) == 1
        proc.wait()
        assert main(probe) == 1  # reaped: gone
    finally:
        proc.kill()
        proc.wait()
        httpd.shutdown()
    assert main(["check-stubs", "--url", "127.0.0.1:1", "--state", str(state)]) == 1
