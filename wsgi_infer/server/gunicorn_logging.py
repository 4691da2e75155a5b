"""gunicorn's logger, with the real client address in the access log behind a proxy."""

from __future__ import annotations

import ipaddress

from gunicorn.glogging import Logger


class ProxyAwareLogger(Logger):
    """``%(h)s`` is the client as the trusted proxy saw it.

    When the peer is in ``forwarded_allow_ips`` (or comes over a unix socket,
    which only a local proxy can reach), the address is the rightmost
    X-Forwarded-For entry that is not itself a trusted proxy: entries to its
    left come from the client and could be forged. Only valid IP addresses
    are ever written, so no header text reaches the log.
    """

    def atoms(self, resp, req, environ, request_time):
        atoms = super().atoms(resp, req, environ, request_time)
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
