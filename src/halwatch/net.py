"""Network basics shared by the servers and the clients: is a host this machine's loopback (servers refuse to listen
beyond it without a key; clients warn before sending a key over plain HTTP beyond it), and secrets read from a named
environment variable."""

from __future__ import annotations

import ipaddress
import os

from halwatch.errors import HalwatchError


def loopback(host: str) -> bool:
    """True for ``localhost``, an empty host and loopback addresses (127.0.0.0/8, ::1)."""
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def env_secret(env_var: str | None, option: str) -> str | None:
    """The secret in the environment variable ``env_var`` (``None`` without a name). An unset or empty variable is
    an error naming ``option`` (so that a typo does not silently mean "no key")."""
    if not env_var:
        return None
    value = os.environ.get(env_var, "")
    if not value:
        raise HalwatchError(f"{option} {env_var}: the environment variable is not set or empty")
    return value
