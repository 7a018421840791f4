"""The Schema Registry REST client (processors/kafka/schema_registry.py): the requests it sends and how it reads
the answers and errors documented for the Confluent-compatible API. The other side is a local HTTP server that
answers as that documentation says and records what it was asked: it stands for the protocol, not for a
registry's behaviour (no registry runs here: docs/wire-formats.md)."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from branch_settlement.processors.kafka.schema_registry import CONTENT_TYPE, HttpSchemaRegistry
from branch_settlement.schemas.confluent import SchemaRegistryError, SchemaRegistryUnavailable

pytestmark = pytest.mark.unit


class Answers:
    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.routes: dict[tuple[str, str], tuple[int, object]] = {}


@pytest.fixture()
def registry():
    answers = Answers()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            answers.requests.append({"method": self.command, "path": self.path, "headers": dict(self.headers),
                                     "body": json.loads(body) if body else None})
            status, payload = answers.routes.get((self.command, self.path), (404, {"error_code": 404, "message": "?"}))
            raw = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        do_GET = do_POST = _answer

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield answers, f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


SUBJECT = "io.branchsettlement.outputs.CapacityReleased"


def test_register_posts_the_schema_under_its_subject_with_basic_auth(registry) -> None:
    answers, url = registry
    answers.routes[("POST", f"/ccompat/subjects/{SUBJECT}/versions")] = (200, {"id": 17})
    client = HttpSchemaRegistry(url.replace("http://", "http://svc%40acct@") + "/ccompat/", password="s3cret")
    assert client.register(SUBJECT, '{"type":"string"}') == 17
    request = answers.requests[-1]
    assert request["body"] == {"schema": '{"type":"string"}'}
    assert request["headers"]["Content-Type"] == CONTENT_TYPE
    assert request["headers"]["Authorization"] == "Basic " + base64.b64encode(b"svc@acct:s3cret").decode()
    assert "s3cret" not in repr(client)


def test_compatibility_no_subject_yet_refusal_with_reasons(registry) -> None:
    answers, url = registry
    client = HttpSchemaRegistry(url)
    path = f"/compatibility/subjects/{SUBJECT}/versions/latest?verbose=true"
    answers.routes[("POST", path)] = (404, {"error_code": 40401, "message": "Subject not found"})
    assert client.incompatibilities(SUBJECT, "{}") == []
    answers.routes[("POST", path)] = (200, {"is_compatible": False, "messages": ["READER_FIELD_MISSING_DEFAULT_VALUE"]})
    assert client.incompatibilities(SUBJECT, "{}") == ["READER_FIELD_MISSING_DEFAULT_VALUE"]
    answers.routes[("POST", path)] = (200, {"is_compatible": True})
    assert client.incompatibilities(SUBJECT, "{}") == []


def test_schema_by_id_and_an_unknown_id(registry) -> None:
    answers, url = registry
    answers.routes[("GET", "/schemas/ids/5")] = (200, {"schema": '{"type":"long"}'})
    answers.routes[("GET", "/schemas/ids/6")] = (404, {"error_code": 40403, "message": "Schema not found"})
    client = HttpSchemaRegistry(url)
    assert client.schema_by_id(5) == '{"type":"long"}'
    assert client.schema_by_id(6) is None


def test_refusals_and_unavailability_are_told_apart(registry) -> None:
    answers, url = registry
    client = HttpSchemaRegistry(url, timeout_s=2)
    answers.routes[("GET", "/schemas/ids/1")] = (500, {"error_code": 50001, "message": "store error"})
    with pytest.raises(SchemaRegistryUnavailable, match="HTTP 500 store error"):
        client.schema_by_id(1)
    answers.routes[("POST", f"/subjects/{SUBJECT}/versions")] = (401, {"error_code": 401, "message": "Unauthorized"})
    with pytest.raises(SchemaRegistryError, match="refused registering .*HTTP 401 Unauthorized \\(credentials\\?\\)"):
        client.register(SUBJECT, "{}")
    answers.routes[("POST", f"/subjects/{SUBJECT}/versions")] = (422, {"error_code": 42201, "message": "Invalid schema"})
    with pytest.raises(SchemaRegistryError, match="HTTP 422 Invalid schema") as refused:
        client.register(SUBJECT, "{}")
    assert not isinstance(refused.value, SchemaRegistryUnavailable)
    with pytest.raises(SchemaRegistryUnavailable, match="did not answer within 2 s"):
        HttpSchemaRegistry("http://127.0.0.1:1", timeout_s=2).schema_by_id(1)


def test_a_url_that_is_not_http_is_refused_at_once() -> None:
    with pytest.raises(SchemaRegistryError, match="expected http"):
        HttpSchemaRegistry("registry:8081")


def test_a_password_in_the_url_is_refused() -> None:
    """It would show in process listings and logs: the user goes in its setting, the password in a file."""
    with pytest.raises(SchemaRegistryError, match="a password in the URL is refused") as refused:
        HttpSchemaRegistry("https://svc:s3cret@registry:8081")
    assert "s3cret" not in str(refused.value)
