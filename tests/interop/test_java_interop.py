"""Interop with another language's official Avro library: Apache Avro's Java implementation (from Maven
Central) checks the shared vectors knowing nothing of the project but each record's schema
(tests/interop/java/CheckVectors.java): both encodings decode to the record the Avro JSON describes, and the
record encodes back to the same bytes. A vector with one byte changed is caught, so the check can fail.

Needs Java 17 and Maven (as the local broker does, deploy/kafka.sh); the jars are cached in .cache/."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.interop.vectors import VECTORS

REPO = Path(__file__).resolve().parents[2]
JAVA_DIR = Path(__file__).resolve().parent / "java"
LIB = REPO / ".cache" / "interop-java" / "lib"
M2 = Path(os.environ.get("KAFKA_M2_DIR", REPO / ".cache" / "m2"))


@pytest.fixture(scope="module")
def avro_classpath() -> str:
    for tool in ("java", "mvn"):
        assert shutil.which(tool), f"{tool} is needed (Java 17 and Maven, as for deploy/kafka.sh)"
    if not list(LIB.glob("avro-*.jar")):
        done = subprocess.run(
            ["mvn", "--batch-mode", "--no-transfer-progress", "--quiet", "--file", str(JAVA_DIR / "pom.xml"),
             f"-Dmaven.repo.local={M2}", "dependency:copy-dependencies", f"-DoutputDirectory={LIB}"],
            capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return str(LIB / "*")


def check(classpath: str, vectors: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["java", "-cp", classpath, str(JAVA_DIR / "CheckVectors.java"), str(vectors)],
                          capture_output=True, text=True, timeout=300)


def test_apache_avro_java_reads_and_writes_every_vector_alike(avro_classpath) -> None:
    names = [json.loads(line)["name"] for line in VECTORS.read_text().splitlines()]
    done = check(avro_classpath, VECTORS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[:-1] == [f"ok {name}" for name in names]
    assert done.stdout.splitlines()[-1] == f"{len(names)} passed, 0 failed"


def test_a_changed_byte_is_caught(avro_classpath, tmp_path) -> None:
    vectors = [json.loads(line) for line in VECTORS.read_text().splitlines()]
    released = next(v for v in vectors if v["name"] == "CapacityReleased")
    result = next(v for v in vectors if v["name"] == "SettlementResult")
    framed = bytearray.fromhex(released["confluent"])
    framed[4] ^= 1  # another schema id
    released["confluent"] = framed.hex()
    single = bytearray.fromhex(result["single_object"])
    single[5] ^= 1  # another fingerprint
    result["single_object"] = single.hex()
    changed = tmp_path / "vectors.jsonl"
    changed.write_text("".join(json.dumps(v) + "\n" for v in vectors))
    done = check(avro_classpath, changed)
    assert done.returncode == 1, done.stdout + done.stderr
    failed = sorted(line.split(":")[0] for line in done.stdout.splitlines() if line.startswith("FAIL"))
    assert failed == ["FAIL CapacityReleased", "FAIL SettlementResult"], done.stdout + done.stderr
