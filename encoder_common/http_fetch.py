"""Downloads an image named by an http(s):// URL for a caller, bounded in size and time, optionally
refusing redirects and addresses inside the cluster (loopback, private, link-local).

The address check runs on the socket actually connected, after DNS, so a name that resolves (or
re-resolves) to an internal address is refused too.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import time
import urllib.error
import urllib.request

from encoder_common.errors import InvalidItemError


def is_internal_address(host: str) -> bool:
    """Whether an IP address is one a fetch on a caller's behalf must not reach (the cluster's own)."""
    address = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return (
        address.is_loopback
        or address.is_private
        or address.is_link_local
        or address.is_unspecified
        or address.is_multicast
        or address.is_reserved
    )


class _RefusedAddress(Exception):
    pass


def _check_peer(sock: socket.socket) -> None:
    host = sock.getpeername()[0]
    if is_internal_address(host):
        sock.close()
        raise _RefusedAddress(host)


class _PublicHTTPConnection(http.client.HTTPConnection):
    def connect(self) -> None:
        super().connect()
        _check_peer(self.sock)


class _PublicHTTPSConnection(http.client.HTTPSConnection):
    def connect(self) -> None:
        super().connect()  # TCP connect and TLS handshake; the peer is the same socket's
        _check_peer(self.sock)


class _PublicHTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req):
        return self.do_open(_PublicHTTPConnection, req)


class _PublicHTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req):
        return self.do_open(_PublicHTTPSConnection, req, context=self._context)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise InvalidItemError(
            f"fetching {_shown(req.full_url)} was redirected (HTTP {code}); redirects are not followed"
        )


def _opener(*, follow_redirects: bool, allow_internal: bool) -> urllib.request.OpenerDirector:
    # http(s) only: no file:, ftp: or data: handler that a redirect could reach, and no proxy from
    # the environment.
    opener = urllib.request.OpenerDirector()
    handlers = [
        urllib.request.HTTPHandler() if allow_internal else _PublicHTTPHandler(),
        urllib.request.HTTPSHandler() if allow_internal else _PublicHTTPSHandler(),
        urllib.request.HTTPRedirectHandler() if follow_redirects else _NoRedirect(),
        urllib.request.HTTPDefaultErrorHandler(),
        urllib.request.HTTPErrorProcessor(),
    ]
    for handler in handlers:
        opener.add_handler(handler)
    return opener


_OPENERS = {
    (follow, internal): _opener(follow_redirects=follow, allow_internal=internal)
    for follow in (False, True)
    for internal in (False, True)
}


def _shown(url: str) -> str:
    return url if len(url) <= 200 else url[:200] + "..."


def fetch_http(
    url: str,
    *,
    max_bytes: int,
    timeout_s: float,
    follow_redirects: bool = True,
    allow_internal: bool = True,
    user_agent: str = "encoder-service",
) -> bytes:
    """Downloads `url`, refusing bodies over `max_bytes` and downloads that take over `timeout_s`.

    `follow_redirects=False` refuses any redirect; `allow_internal=False` refuses to connect to a
    loopback, private, link-local, multicast or reserved address. Every refusal is an InvalidItemError.
    """
    shown = _shown(url)
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(url, headers={"User-Agent": user_agent})
    try:
        with _OPENERS[follow_redirects, allow_internal].open(request, timeout=timeout_s) as response:
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                raise InvalidItemError(f"{shown} is {length} bytes, over the limit of {max_bytes}")
            parts, received = [], 0
            while received <= max_bytes:
                if time.monotonic() > deadline:
                    raise InvalidItemError(f"fetching {shown} took over {timeout_s:g} s")
                part = response.read(min(1 << 16, max_bytes + 1 - received))
                if not part:
                    break
                parts.append(part)
                received += len(part)
            if received > max_bytes:
                raise InvalidItemError(f"{shown} is over the limit of {max_bytes} bytes")
            return b"".join(parts)
    except InvalidItemError:
        raise
    except _RefusedAddress as exc:
        raise InvalidItemError(
            f"fetching {shown} refused: it resolves to {exc.args[0]}, a loopback, private or link-local address"
        ) from None
    except urllib.error.HTTPError as exc:
        raise InvalidItemError(f"fetching {shown} failed: HTTP {exc.code}") from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, _RefusedAddress):
            raise InvalidItemError(
                f"fetching {shown} refused: it resolves to {exc.reason.args[0]}, a loopback, private or "
                "link-local address"
            ) from None
        if isinstance(exc.reason, InvalidItemError):
            raise exc.reason from None
        if isinstance(exc.reason, TimeoutError):
            raise InvalidItemError(f"fetching {shown} took over {timeout_s:g} s") from None
        raise InvalidItemError(f"fetching {shown} failed: {exc.reason}") from None
    except TimeoutError:  # socket.timeout is its alias
        raise InvalidItemError(f"fetching {shown} took over {timeout_s:g} s") from None
    except (http.client.HTTPException, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc.__class__.__name__
        raise InvalidItemError(f"fetching {shown} failed: {reason}") from None
