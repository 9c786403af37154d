"""Who may talk to the server: API keys, browser origins (CORS) and Host names.

A local inference server is reachable by every web page the user visits: the
browser will send requests to ``127.0.0.1`` for any page. Three guards keep
those pages out when no API key is set (the default):

* **Origins.** No CORS headers are sent unless origins are configured
  (``cors_origins``, like Ollama's ``OLLAMA_ORIGINS``), so a page cannot read
  any answer; a request that carries a browser ``Origin`` not configured is
  refused outright (403), so it cannot spend compute either.
* **Host.** On a loopback socket, a request whose ``Host`` is not a loopback
  name or address is refused (403): that is DNS rebinding, a page on
  ``evil.example`` whose name now resolves to 127.0.0.1.
* **Content type.** JSON bodies only (see :mod:`.body`): the content types a
  page may send without a CORS preflight are refused.

Secrets never reach logs or error bodies: keys are compared in constant time and
isolation domains are digests of them.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import ApiError

_ALLOW_METHODS = "GET, POST, DELETE, OPTIONS"
_ALLOW_HEADERS = (
    "Content-Type, Authorization, x-api-key, anthropic-version, anthropic-beta, "
    "anthropic-dangerous-direct-browser-access, openai-organization, openai-project, "
    "x-stainless-arch, x-stainless-lang, x-stainless-os, x-stainless-package-version, "
    "x-stainless-retry-count, x-stainless-runtime, x-stainless-runtime-version, "
    "x-stainless-timeout"
)
_EXPOSE_HEADERS = "X-Session-Cache, X-Cached-Tokens, Retry-After, retry-after"


def split_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


@dataclass(frozen=True)
class OriginPolicy:
    """Browser origins allowed to call the server: exact origins or fnmatch
    patterns (``http://localhost:*``); ``*`` allows every origin."""

    patterns: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> OriginPolicy:
        return cls(tuple(p.rstrip("/").lower() for p in split_list(text)))

    def allows(self, origin: str) -> bool:
        origin = origin.rstrip("/").lower()
        return any(p == "*" or fnmatch.fnmatchcase(origin, p) for p in self.patterns)

    def headers(self, origin: str) -> dict[str, str]:
        """CORS headers for an allowed ``origin`` (its own value, never ``*``,
        so credentials and caches behave)."""
        return {
            "Access-Control-Allow-Origin": origin,
            "Access-Control-Expose-Headers": _EXPOSE_HEADERS,
            "Vary": "Origin",
        }

    def preflight_headers(self, origin: str, requested_headers: str | None) -> dict[str, str]:
        """An allowed origin may send the headers it asks for (the SDKs add new
        ones over time); without a request list, the ones clients are known to use."""
        return {
            **self.headers(origin),
            "Access-Control-Allow-Methods": _ALLOW_METHODS,
            "Access-Control-Allow-Headers": requested_headers or _ALLOW_HEADERS,
            "Access-Control-Max-Age": "600",
        }

    def refusal(self, origin: str) -> ApiError:
        return ApiError(
            403,
            f"Origin {origin!r} is not allowed to use this server; to let a web page "
            "call it, list its origin in MLXTRIO_CORS_ORIGINS (or --cors-origins)",
            "permission_error",
        )


@dataclass(frozen=True)
class HostPolicy:
    """The ``Host`` names accepted on a loopback socket (DNS-rebinding guard).

    Loopback names and addresses are always accepted; ``extra`` adds names (or
    patterns) for reverse proxies that keep the public ``Host``; ``*`` turns the
    check off. Requests that arrived on a non-loopback socket are not checked:
    the server was bound there on purpose."""

    extra: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> HostPolicy:
        return cls(tuple(h.lower() for h in split_list(text)))

    def check(self, host_header: str | None, server: Sequence[object] | None) -> ApiError | None:
        if host_header is None or not server or not _is_loopback(str(server[0])):
            return None
        name = _hostname(host_header)
        if is_loopback_name(name):
            return None
        if any(p == "*" or fnmatch.fnmatchcase(name, p) for p in self.extra):
            return None
        return ApiError(
            403,
            f"Host {name!r} is not allowed on a loopback address (DNS rebinding guard); "
            "use localhost or 127.0.0.1, or add the name to MLXTRIO_ALLOWED_HOSTS",
            "permission_error",
        )


def _hostname(host_header: str) -> str:
    """``Example.com.:8000`` -> ``example.com``; ``[::1]:8000`` -> ``::1``.
    Anything that is not ``host[:port]`` yields "" (never a loopback name)."""
    host = host_header.strip().lower()
    if host.startswith("["):
        address, _, rest = host[1:].partition("]")
        return address if rest == "" or (rest[0] == ":" and rest[1:].isdigit()) else ""
    name, _, port = host.partition(":")
    if port and not port.isdigit():
        return ""
    return name.removesuffix(".")  # "localhost." is the same name


def is_loopback_name(host: str) -> bool:
    """``localhost`` (and ``*.localhost``) or a loopback address."""
    name = host.lower().removesuffix(".")
    return name == "localhost" or name.endswith(".localhost") or _is_loopback(name)


def _is_loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


class ApiKeys:
    """Configured API keys: none (open), one, or several (each its own cache and
    store isolation domain, named by a digest of the key, never the key)."""

    def __init__(self, text: str) -> None:
        self.keys = split_list(text)
        self._domains = {k: "key:" + hashlib.sha256(k.encode()).hexdigest()[:24] for k in self.keys}

    def __bool__(self) -> bool:
        return bool(self.keys)

    def authenticate(self, x_api_key: str | None, authorization: str | None) -> str:
        """The isolation domain of the key a request carries in its ``x-api-key``
        or ``Authorization: Bearer`` header ("" with one key configured);
        raises a 401 :class:`ApiError`."""
        supplied = x_api_key
        if supplied is None:
            scheme, _, token = (authorization or "").partition(" ")
            supplied = token.strip() if scheme.lower() == "bearer" else None
        if supplied is None:
            raise ApiError(
                401,
                "Missing API key: send it in x-api-key or Authorization: Bearer",
                "authentication_error",
            )
        # Compare with every key, so the time taken does not tell which one matched.
        matches = [hmac.compare_digest(supplied.encode(), key.encode()) for key in self.keys]
        if not any(matches):
            raise ApiError(401, "Invalid API key", "authentication_error")
        return self._domains[self.keys[matches.index(True)]] if len(self.keys) > 1 else ""
