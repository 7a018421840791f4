"""A client of the Confluent-compatible Schema Registry REST API, the `SchemaSource` of schemas/confluent.py.

Speaks the subset the codec needs, as documented for Confluent Schema Registry and implemented by the
registries that copy its API (Apicurio Registry under /apis/ccompat/v7, Karapace, Redpanda):

    GET  /schemas/ids/{id}                                  -> {"schema": "..."}; 404 (40403) if no such id
    POST /subjects/{subject}/versions                       {"schema": "..."} -> {"id": n}
    POST /compatibility/subjects/{subject}/versions/latest?verbose=true
                                                            -> {"is_compatible": bool, "messages": [...]};
                                                               404 (40401/40402) if the subject has no version

Standard library only (urllib): a timeout on every request, HTTP basic auth from the URL's user info or
`username`/`password`, TLS with a CA file. A registry that does not answer (refused, timed out, a 5xx) is
`SchemaRegistryUnavailable`; any other refusal is `SchemaRegistryError` with the registry's own message.
"""

from __future__ import annotations

import base64
import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from branch_settlement.schemas.confluent import SchemaRegistryError, SchemaRegistryUnavailable

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
DEFAULT_TIMEOUT_S = 10.0
_NO_SUCH_SUBJECT = {40401, 40402}  # subject not found, version not found
_NO_SUCH_SCHEMA = 40403


class HttpSchemaRegistry:
    """The registry at `url` (its REST root, e.g. http://127.0.0.1:8081 or http://host:8080/apis/ccompat/v7)."""

    def __init__(self, url: str, *, username: str | None = None, password: str | None = None,
                 ca_location: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SchemaRegistryError(f"schema registry URL {url!r}: expected http(s)://HOST[:PORT][/PATH]")
        if parts.password is not None:  # a password in a URL shows in process listings, shell history and logs
            raise SchemaRegistryError("schema registry URL: a password in the URL is refused; give the user as "
                                      "schema_registry_username (--schema-registry-username) and the password in "
                                      "a file (schema_registry_password_file)")
        if parts.username is not None:
            username = username or urllib.parse.unquote(parts.username)
        netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
        self.url = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
        self.timeout_s = timeout_s
        self._auth = None
        if username:
            token = base64.b64encode(f"{username}:{password or ''}".encode()).decode()
            self._auth = f"Basic {token}"
        self._context = ssl.create_default_context(cafile=ca_location) if parts.scheme == "https" else None

    def __repr__(self) -> str:
        return f"HttpSchemaRegistry({self.url!r})"

    # -- SchemaSource ------------------------------------------------------------------------------------

    def schema_by_id(self, schema_id: int) -> str | None:
        status, body = self._request("GET", f"/schemas/ids/{int(schema_id)}")
        if status == 404 and _code(body) in (_NO_SUCH_SCHEMA, None):
            return None
        self._expect_ok(status, body, f"schema id {schema_id}")
        return body["schema"]

    def register(self, subject: str, schema: str) -> int:
        status, body = self._request("POST", f"/subjects/{_quote(subject)}/versions", {"schema": schema})
        self._expect_ok(status, body, f"registering {subject}")
        return int(body["id"])

    def incompatibilities(self, subject: str, schema: str) -> list[str]:
        status, body = self._request("POST", f"/compatibility/subjects/{_quote(subject)}/versions/latest"
                                     "?verbose=true", {"schema": schema})
        if status == 404 and _code(body) in _NO_SUCH_SUBJECT | {None}:
            return []  # no version yet: anything may be the first
        self._expect_ok(status, body, f"checking {subject}")
        if body.get("is_compatible"):
            return []
        return [str(m) for m in body.get("messages") or []] or ["incompatible with the latest version"]

    # -- HTTP ----------------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, payload: Any = None) -> tuple[int, Any]:
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Accept": CONTENT_TYPE, "Content-Type": CONTENT_TYPE})
        if self._auth:
            request.add_header("Authorization", self._auth)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=self._context) as response:
                return response.status, _json(response.read())
        except urllib.error.HTTPError as err:
            body = _json(err.read())
            if err.code >= 500:
                raise SchemaRegistryUnavailable(f"schema registry at {self.url}: {method} {path.split('?')[0]}: "
                                                f"HTTP {err.code} {_message(body)}") from None
            return err.code, body
        except (urllib.error.URLError, OSError) as err:  # refused, unreachable, timed out, TLS
            reason = getattr(err, "reason", err)
            raise SchemaRegistryUnavailable(f"schema registry at {self.url} did not answer within "
                                            f"{self.timeout_s:g} s: {reason}") from None

    def _expect_ok(self, status: int, body: Any, what: str) -> None:
        if status == 401 or status == 403:
            raise SchemaRegistryError(f"schema registry at {self.url} refused {what}: HTTP {status} "
                                      f"{_message(body)} (credentials?)")
        if not 200 <= status < 300 or not isinstance(body, dict):
            raise SchemaRegistryError(f"schema registry at {self.url}: {what}: HTTP {status} {_message(body)}")


def _quote(subject: str) -> str:
    return urllib.parse.quote(subject, safe="")


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw[:200].decode(errors="replace")


def _code(body: Any) -> int | None:
    return body.get("error_code") if isinstance(body, dict) else None


def _message(body: Any) -> str:
    if isinstance(body, dict):
        return str(body.get("message") or body.get("detail") or body)
    return str(body or "")


__all__ = ["HttpSchemaRegistry", "CONTENT_TYPE", "DEFAULT_TIMEOUT_S"]
