"""The network-fault scenario, run inside a private network namespace (`unshare -n`): its own loopback, its
own broker, the processor, the reader and the verifier all inside it, and iptables rules that exist only
there. Nothing outside the namespace can be touched: the shared broker is not even reachable from it.

`run_in_namespace(...)` (outside) starts `unshare -n python -m faults.netns CONFIG` and returns the
scenario's report; `main` (inside) brings loopback up, starts the broker and runs the scenario."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from faults.kafka_io import REPO, OwnBroker

BROKER_PORT = 29092
CONTROLLER_PORT = 29093


def ensure_tools() -> None:
    """iptables from Debian when missing (the namespace has no network to fetch it from)."""
    if shutil.which("iptables") and shutil.which("unshare") and shutil.which("ip"):
        return
    if os.geteuid() != 0:
        raise RuntimeError("the network scenario needs root (unshare -n, iptables)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "iptables", "iproute2"]):
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{done.stderr[-2000:]}")


def run_in_namespace(work_dir: Path, seed: int, events: int, partitions: int, outages_s: tuple, stall_s: float,
                     timeout_s: float = 2400) -> dict:
    ensure_tools()
    work_dir.mkdir(parents=True, exist_ok=True)
    out = work_dir / "netns-report.json"
    out.unlink(missing_ok=True)
    config = {"work_dir": str(work_dir), "seed": seed, "events": events, "partitions": partitions,
              "outages_s": list(outages_s), "out": str(out), "stall_s": stall_s}
    log = open(work_dir / "netns-driver.log", "wb")
    proc = subprocess.Popen(["unshare", "-n", sys.executable, "-m", "faults.netns", json.dumps(config)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        log.close()
        # Whatever happened inside, no broker of ours survives it (pids are shared with the namespace).
        OwnBroker(work_dir / "kafka", BROKER_PORT, CONTROLLER_PORT).ensure_stopped()
    if not out.exists():
        tail = (work_dir / "netns-driver.log").read_text(errors="replace")[-4000:]
        raise RuntimeError(f"the network scenario wrote no report (exit {proc.returncode}):\n{tail}")
    return json.loads(out.read_text())


def main(argv: list[str]) -> int:
    from faults.scenarios import Run, Size, network_blackhole

    config = json.loads(argv[0])
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    work_dir = Path(config["work_dir"])
    broker = OwnBroker(work_dir / "kafka", BROKER_PORT, CONTROLLER_PORT)
    run = None
    try:
        broker.up()
        run = Run("network_blackhole", config["seed"], Size(config["events"], config["partitions"]), broker.bootstrap,
                  work_dir / "run", stall_s=config["stall_s"])
        run.setup()
        report = network_blackhole(run, BROKER_PORT, tuple(config["outages_s"]))
        report["where"] = "own broker and processor in a private network namespace (unshare -n), iptables DROP"
    except Exception as exc:  # reported, not raised: the parent reads the file
        import traceback
        report = {"scenario": "network_blackhole", "seed": config["seed"], "ok": False,
                  "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    finally:
        subprocess.run(["iptables", "-F", "INPUT"], check=False)
        if run is not None:
            run.cleanup()
        broker.ensure_stopped()
    Path(config["out"]).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
