"""Who can reach a server: an unkeyed one must listen on loopback only.

Both servers follow it: the inference server (`trajflow serve`, ``start_server``) refuses another bind address
without a key; `trajflow backend serve` does the same with its own message. Light on purpose (no FastAPI):
the command-line parsers import it.
"""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """True for ``localhost`` (any case) and loopback addresses (127.0.0.0/8, ::1); False for wildcards and others."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: str | None) -> None:
    """An unkeyed server must stay on loopback: ValueError for any other bind address without a key."""
    if not api_key and not is_loopback(host):
        raise ValueError(f"binding {host} needs an API key (--api-key or $TRAJFLOW_API_KEY): without one, anyone who "
                         "reaches the port can generate and load adapters; an unkeyed server stays on 127.0.0.1")
