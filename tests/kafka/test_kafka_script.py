"""deploy/kafka.sh as a developer and CI use it: up, status, up again, down, down again; and a clear refusal
when the port is taken. The lifecycle runs its own broker on free ports with its own state directory, so it
never disturbs the session's broker; it reuses the jar cache."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.kafka

KAFKA_SH = Path(__file__).resolve().parents[2] / "deploy" / "kafka.sh"
# Generous: the first test of a fresh machine may install Kafka from Maven Central.
SCRIPT_TIMEOUT_S = 600


def kafka_sh(command: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(KAFKA_SH), command], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=SCRIPT_TIMEOUT_S)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_up_status_down_are_safe_to_repeat(tmp_path):
    port, controller_port = free_port(), free_port()
    env = {"KAFKA_PORT": str(port), "KAFKA_CONTROLLER_PORT": str(controller_port),
           "KAFKA_RUN_DIR": str(tmp_path / "run")}
    try:
        up = kafka_sh("up", env)
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"up on 127.0.0.1:{port}" in up.stdout
        pid = (tmp_path / "run" / "pid").read_text().strip()

        status = kafka_sh("status", env)
        assert status.returncode == 0, status.stdout + status.stderr
        assert f"running: pid {pid}" in status.stdout
        assert f"127.0.0.1:{port}" in status.stdout and f"127.0.0.1:{controller_port}" in status.stdout

        again = kafka_sh("up", env)
        assert again.returncode == 0, again.stdout + again.stderr
        assert again.stdout.strip() == f"kafka: already running (pid {pid}) on 127.0.0.1:{port}"
        assert (tmp_path / "run" / "pid").read_text().strip() == pid
    finally:
        down = kafka_sh("down", env)
    assert down.returncode == 0, down.stdout + down.stderr
    assert down.stdout.strip() == f"kafka: stopped (pid {pid})"
    assert not (tmp_path / "run" / "pid").exists()

    status = kafka_sh("status", env)
    assert status.returncode == 3 and "not running" in status.stdout
    again = kafka_sh("down", env)
    assert again.returncode == 0 and again.stdout.strip() == "kafka: not running"


def test_up_refuses_a_port_in_use_with_one_clear_line(tmp_path):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        up = kafka_sh("up", {"KAFKA_PORT": str(port), "KAFKA_CONTROLLER_PORT": str(free_port()),
                             "KAFKA_RUN_DIR": str(tmp_path / "run")})
    assert up.returncode == 1
    assert f"port {port} (broker) on 127.0.0.1 is in use" in up.stderr
    assert "Exception" not in up.stderr and "Traceback" not in up.stderr


def test_status_of_a_broker_that_is_not_running(tmp_path):
    status = kafka_sh("status", {"KAFKA_PORT": str(free_port()), "KAFKA_RUN_DIR": str(tmp_path / "run")})
    assert status.returncode == 3
    assert "kafka: not running" in status.stdout


@pytest.mark.slow
def test_a_controller_and_a_broker_as_two_processes(tmp_path):
    """KAFKA_ROLE: the fault suite's cluster. The broker joins the controller's quorum, answers for the
    shared cluster id, and can be stopped and started again while the controller stays up."""
    port, controller_port = free_port(), free_port()
    common = {"KAFKA_PORT": str(port), "KAFKA_CONTROLLER_PORT": str(controller_port),
              "KAFKA_CLUSTER_ID": "c2V0dGxlbWVudC10ZXN0MQ"}
    controller = {**common, "KAFKA_ROLE": "controller", "KAFKA_RUN_DIR": str(tmp_path / "controller")}
    broker = {**common, "KAFKA_ROLE": "broker", "KAFKA_RUN_DIR": str(tmp_path / "broker")}
    try:
        up = kafka_sh("up", controller)
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"controller up on 127.0.0.1:{controller_port}" in up.stdout
        up = kafka_sh("up", broker)
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"up on 127.0.0.1:{port}" in up.stdout
        config = (tmp_path / "broker" / "server.properties").read_text()
        assert "process.roles=broker\n" in config and "node.id=2\n" in config
        assert "process.roles=broker,controller" not in config
        for role in ("controller", "broker"):
            meta = (tmp_path / role / "data" / "meta.properties").read_text()
            assert "cluster.id=c2V0dGxlbWVudC10ZXN0MQ" in meta, (role, meta)

        down = kafka_sh("down", broker)
        assert down.returncode == 0 and "stopped" in down.stdout, down.stdout + down.stderr
        assert kafka_sh("status", controller).returncode == 0  # the controller stays up
        again = kafka_sh("up", broker)
        assert again.returncode == 0, again.stdout + again.stderr
    finally:
        for env in (broker, controller):
            kafka_sh("down", env)
    assert kafka_sh("status", broker).returncode == 3
    assert kafka_sh("status", controller).returncode == 3


def test_an_unknown_role_is_refused_with_one_clear_line(tmp_path):
    up = kafka_sh("up", {"KAFKA_ROLE": "leader", "KAFKA_PORT": str(free_port()),
                         "KAFKA_RUN_DIR": str(tmp_path / "run")})
    assert up.returncode == 2
    assert up.stderr.strip() == "kafka: KAFKA_ROLE is 'leader'; it must be combined, controller or broker."


BROKER_SH = KAFKA_SH.with_name("broker.sh")


def test_make_uses_the_broker_the_environment_names_or_says_why_not(kafka_bootstrap: str) -> None:
    """deploy/broker.sh (make demo, make test): a cluster that answers at SETTLE_BOOTSTRAP_SERVERS is used,
    whoever started it; a remote one that does not answer is one clear line and exit 1, nothing started."""
    used = subprocess.run(["bash", str(BROKER_SH)], env={**os.environ, "SETTLE_BOOTSTRAP_SERVERS": kafka_bootstrap},
                          capture_output=True, text=True, timeout=60)
    assert used.returncode == 0 and f"using the Kafka cluster at {kafka_bootstrap}" in used.stdout, used.stderr
    refused = subprocess.run(["bash", str(BROKER_SH)], env={**os.environ, "SETTLE_BOOTSTRAP_SERVERS": "192.0.2.1:9092"},
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.strip().splitlines() == [
        "broker: no Kafka broker answers at 192.0.2.1:9092 (SETTLE_BOOTSTRAP_SERVERS), and it is not a local "
        "address deploy/kafka.sh could start one on"]
