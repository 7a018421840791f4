"""Progress of the Kafka commands against the real broker: produce, export, replay --topic and audit --topic
show a tqdm bar when stderr is a terminal (a pty), and their stdout is the same bytes as without one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from branch_settlement.processors.crosscheck.progress import count_lines
from branch_settlement.processors.workload import write_jsonl
from tests.cli.terminal import only_progress, settle, settle_on_terminal
from tests.kafka.pipeline import count_records

pytestmark = pytest.mark.kafka


def test_the_kafka_commands_show_progress_on_a_terminal_only(kafka_topics, tmp_path: Path) -> None:
    common = ("--topic-prefix", kafka_topics.prefix, "--bootstrap-servers", kafka_topics.bootstrap_servers)
    events = tmp_path / "events.jsonl"
    write_jsonl(str(events), 41, 3_000)
    lines = count_lines(str(events))
    code, stdout, shown = settle_on_terminal("produce", str(events), *common)
    assert code in (0, 1), shown[-2000:]  # 1: the workload's malformed lines were refused
    assert b"sent: 100%" in shown and f"{lines}/{lines}".encode() in shown, shown[-1000:]
    assert re.fullmatch(rb"published \d+ events to \S+ \(\d+ partitions\)(; \d+ lines not sent)?\n", stdout), stdout
    assert b"not sent" in shown  # the refused lines, on the terminal with the bar
    records = count_records(kafka_topics.bootstrap_servers, kafka_topics.name("branch-events"))

    plain = settle("export", "-o", str(tmp_path / "plain.avro"), *common)
    code, stdout, shown = settle_on_terminal("export", "-o", str(tmp_path / "plain.avro"), *common)
    assert plain.returncode == 0 == code and stdout == plain.stdout and only_progress(plain.stderr)
    assert b"read: 100%" in shown and b"written: 100%" in shown and f"{records}/{records}".encode() in shown

    plain = settle("replay", "--topic", "branch-events", *common, "--group-id", "nobody")
    code, stdout, shown = settle_on_terminal("replay", "--topic", "branch-events", *common, "--group-id", "nobody")
    assert plain.returncode == 0 == code and only_progress(plain.stderr)
    assert stdout.splitlines()[1:] == plain.stdout.splitlines()[1:]  # the first line has the run's timing
    assert b"replayed: 100%" in shown, shown[-1000:]

    parent = next(line.split('"parent_id":"')[1].split('"')[0] for line in events.read_text().splitlines()
                  if '"ParentReserved"' in line)
    plain = settle("audit", parent, "--topic", "branch-events", *common)
    code, stdout, shown = settle_on_terminal("audit", parent, "--topic", "branch-events", *common)
    assert plain.returncode == 0 == code and stdout == plain.stdout and only_progress(plain.stderr)
    assert b"read: 100%" in shown
    code, stdout, shown = settle_on_terminal("audit", parent, "--topic", "branch-events", *common, "--no-progress")
    assert code == 0 and stdout == plain.stdout and shown == b""


def test_produce_and_export_print_json_when_asked(kafka_topics, tmp_path: Path) -> None:
    import json

    common = ("--topic-prefix", kafka_topics.prefix, "--bootstrap-servers", kafka_topics.bootstrap_servers)
    events = tmp_path / "events.jsonl"
    write_jsonl(str(events), 42, 500)
    run = settle("produce", str(events), *common, "--json")
    assert run.returncode in (0, 1), run.stderr
    doc = json.loads(run.stdout)
    assert doc["topic"] == kafka_topics.name("branch-events") and doc["partitions"] > 0 and doc["published"] > 0
    assert all(set(refused) == {"line", "reason"} for refused in doc["not_sent"])
    assert (run.returncode == 1) == bool(doc["not_sent"])
    assert count_records(kafka_topics.bootstrap_servers, kafka_topics.name("branch-events")) == doc["published"]
    export = settle("export", "-o", str(tmp_path / "events.avro"), *common, "--json")
    assert export.returncode == 0, export.stderr
    assert json.loads(export.stdout) == {"output": str(tmp_path / "events.avro"), "topic": doc["topic"],
                                         "partitions": list(range(doc["partitions"])), "records": doc["published"]}


def test_expected_failures_are_one_line_and_exit_2(kafka_topics, tmp_path: Path) -> None:
    common = ("--topic-prefix", kafka_topics.prefix, "--bootstrap-servers", kafka_topics.bootstrap_servers)
    topic = kafka_topics.name("branch-events")
    for argv, says in (
            (("export", "-o", str(tmp_path / "no" / "dir.avro")), f"no such directory {tmp_path / 'no'}"),
            (("export", "-o", str(tmp_path / "x.avro"), "--partitions", "0,99"), f"--partitions 99: {topic} has "),
            (("replay", "--topic", "branch-events", "--partitions", "99"), f"--partitions 99: {topic} has "),
            (("audit", "P", "--topic", "branch-events", "--partition", "99"), f"--partition 99: {topic} has ")):
        run = settle(*argv, *common)
        err = run.stderr.decode()
        assert run.returncode == 2 and says in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
