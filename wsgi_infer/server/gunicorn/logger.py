"""gunicorn's logger: the real client address behind a proxy, and no control characters."""

from __future__ import annotations

import ipaddress
import re

from gunicorn.glogging import Logger

# gunicorn's parser refuses C0 controls in headers, but C1 controls (0x80-0x9f as it decodes
# them) pass: \x9b starts a terminal escape and \x85 breaks lines for str.splitlines.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class ProxyAwareLogger(Logger):
    """``%(h)s`` is the client as the trusted proxy saw it.

    When the peer is in ``forwarded_allow_ips`` (or comes over a unix socket,
    which only a local proxy can reach), the address is the rightmost
    X-Forwarded-For entry that is not itself a trusted proxy: entries to its
    left come from the client and could be forged. Only valid IP addresses
    are ever written, so no header text reaches the log. Every field that
    does carry client text (user agent, referer, request line, headers) has
    its control characters written as ``\\xNN``, as nginx does.
    """

    def atoms(self, resp, req, environ, request_time):
        atoms = super().atoms(resp, req, environ, request_time)
        atoms["u"] = "-"  # Basic auth's user name: a client may send its API key there, and the log would keep it
        for key, value in atoms.items():
            if isinstance(value, str):
                atoms[key] = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", value)
        trusted = set(self.cfg.forwarded_allow_ips)
        peer = environ.get("REMOTE_ADDR", "")
        forwarded = environ.get("HTTP_X_FORWARDED_FOR", "")
        if forwarded and ("*" in trusted or peer in trusted or not peer):
            for candidate in reversed([part.strip() for part in forwarded.split(",")]):
                try:
                    address = str(ipaddress.ip_address(candidate))
                except ValueError:
                    break
                if address not in trusted:
                    atoms["h"] = address
                    break
        return atoms
