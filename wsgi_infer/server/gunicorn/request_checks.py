"""What HTTP/1.1 asks of a request that gunicorn lets through, checked before the app sees it, as nginx checks it.

A refusal is raised as gunicorn's own parse errors are, so that its ``handle_error`` answers it (in JSON: the
worker's ``write_error``) and closes the connection. Where the client asked for the close, or a body is refused
before it is sent, the request is marked to close instead: its answer says so, and nothing after it is read.
"""

from __future__ import annotations

import re

from gunicorn.http.errors import InvalidHeader, UnsupportedTransferCoding

# RFC 3986's host (an IP literal in brackets, or a registered name, perhaps empty) and an optional port
HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._~!$&'()*+,;=%-]*)(:[0-9]*)?")


class BadHost(InvalidHeader):
    """An HTTP/1.1 request without a Host header, or a Host that names no host: a 400 (RFC 9112, section 3.2)."""

    def __init__(self, value: str | None, req) -> None:
        super().__init__("Host", req)
        self.value = value

    def __str__(self) -> str:
        if self.value is None:
            return "an HTTP/1.1 request must send a Host header"
        return f"the Host header {self.value!r} is not a host name (and port)"


def check_request(req, body_limit: float) -> None:
    """Raise where HTTP/1.1 refuses ``req`` and gunicorn serves it; mark it to close where its client asked to
    (a list naming close) or where it expects to be asked for a body over ``body_limit`` bytes."""
    if req.version > (1, 1):  # HTTP/1.2: answered in the highest version served (RFC 9110, 6.2), not in its own
        req.version = (1, 1)
    hosts = _values(req, "HOST")
    if req.version >= (1, 1) and not hosts:
        raise BadHost(None, req)
    if hosts and not HOST.fullmatch(hosts[0]):  # gunicorn refuses a second Host itself
        raise BadHost(hosts[0], req)
    codings = [coding.strip().lower() for value in _values(req, "TRANSFER-ENCODING") for coding in value.split(",")]
    if any(coding != "chunked" for coding in codings):  # gzip, chunked: gunicorn read on and dropped the gzip
        raise UnsupportedTransferCoding(", ".join(codings))  # a 501, as nginx answers it (RFC 9112, section 6.1)
    if any(token.strip().lower() == "close" for value in _values(req, "CONNECTION") for token in value.split(",")):
        req.must_close = True  # RFC 9112, section 9.6; gunicorn reads close only as the whole of the first value
    if req._expected_100_continue and _length(req) > body_limit:
        # The app's 413 without a 100 (Continue) first, and the close: gunicorn sent it before the app could
        # refuse the body, and read the whole body through after the refusal (RFC 9110, section 10.1.1).
        req._expected_100_continue = False
        req.must_close = True


def _values(req, name: str) -> list[str]:
    return [value for header, value in req.headers if header == name]


def _length(req) -> int:
    """The request's Content-Length (gunicorn has refused one that is not a number), 0 where it sends none."""
    return next((int(value) for value in _values(req, "CONTENT-LENGTH")), 0)
