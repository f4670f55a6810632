"""ZMQ endpoints the way vLLM's publisher treats them: check, offset by DP rank, bind or connect, report.

    check_endpoint("tcp://*:5557")             the string, or ConfigurationError naming the forms
    offset_endpoint("tcp://*:5557", rank=2)    "tcp://*:5559"   (port + data-parallel rank; port 0 and
                                               "*" left for the OS; inproc:// and ipc:// get "_dp2")
    binds("tcp://*:5557")                      True: vLLM binds an endpoint holding "*" or "::", and
                                               every ipc:// or inproc:// one, and connects to the rest
                                               (kvledger adds: a tcp port of 0 or "*" binds, since
                                               nothing can be dialled there)
    dialable("tcp://0.0.0.0:41234")            "tcp://10.1.2.3:41234": a wildcard bind reported with
                                               this node's address ($KVLEDGER_HOST_IP, $VLLM_HOST_IP,
                                               the address of the default route, else 127.0.0.1)
    check_exposure("tcp://*:5557", True, False)  ConfigurationError: a bind that other hosts can reach
                                               (a wildcard, a routable address, an interface or
                                               host name) must be asked for (``allow_remote``):
                                               the events name tenants, their prompts' token ids
                                               and cache salts. Loopback, ipc:// and inproc://
                                               binds, and every connect, need nothing.

Pure functions (``node_ip`` reads the environment and asks the kernel for a route,
sending nothing); the publisher and the CLI use them.
"""

from __future__ import annotations

import ipaddress
import os
import socket

from kvledger.core.errors import ConfigurationError

__all__ = ["DEFAULT_ENDPOINT", "binds", "check_endpoint", "check_exposure", "dialable", "local_bind", "node_ip",
           "offset_endpoint"]

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"  # what a publisher binds when given no endpoint: this host only

_SCHEMES = ("tcp://", "ipc://", "inproc://")
_WILDCARD_HOSTS = ("0.0.0.0", "*", "[::]", "::", "[*]")


def check_endpoint(endpoint, what: str = "endpoint") -> str:
    """``endpoint`` if it looks like a ZMQ tcp / ipc / inproc endpoint; ``ConfigurationError`` otherwise."""
    ok = type(endpoint) is str and endpoint.startswith(_SCHEMES)
    if ok:
        scheme, _, address = endpoint.partition("://")
        ok = bool(address) and (scheme != "tcp" or address.rpartition(":")[2] not in ("", address))
    if not ok:
        raise ConfigurationError(f"{what} must be a ZMQ endpoint such as 'tcp://127.0.0.1:5557', 'tcp://*:5557', "
                                 f"'ipc:///tmp/kv-events' or 'inproc://kv-events'; got {endpoint!r}")
    return endpoint


def _port(endpoint: str) -> str:
    return endpoint.rpartition(":")[2]


def offset_endpoint(endpoint: str, rank: int | None) -> str:
    """The endpoint of data-parallel rank ``rank`` (vLLM's ``offset_endpoint_port``): a tcp port
    plus ``rank`` (0 and ``*`` unchanged: the OS picks), an inproc:// or ipc:// name with
    ``_dp{rank}`` appended; rank 0 or None changes nothing. ``ConfigurationError`` when the
    offset port passes 65535."""
    if not rank:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    if port in ("0", "*") or not port.isdigit():
        return endpoint
    moved = int(port) + rank
    if moved > 65535:
        raise ConfigurationError(f"{endpoint!r} offset by data-parallel rank {rank} is port {moved}, past 65535")
    return f"{base}:{moved}"


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind an endpoint holding ``*`` or ``::`` and every ipc:// or inproc:// one,
    connect to the rest; kvledger also binds a tcp endpoint whose port is 0 (nothing to dial)."""
    return ("*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
            or (endpoint.startswith("tcp://") and _port(endpoint) == "0"))


def local_bind(endpoint: str) -> bool:
    """Whether a bind of ``endpoint`` is reachable from this host only: a tcp endpoint on a
    loopback address (``127.0.0.0/8``, ``[::1]``, ``localhost``), or any ipc:// or inproc://
    one. A wildcard, any other address, an interface or a host name is not."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint[6:].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(endpoint: str, bind: bool, allow_remote: bool, what: str = "endpoint") -> None:
    """``ConfigurationError`` for a bind of ``endpoint`` that other hosts can reach unless
    ``allow_remote`` (module docstring); nothing for a connect or a local bind."""
    if not bind or allow_remote or local_bind(endpoint):
        return
    raise ConfigurationError(
        f"{what} {endpoint!r} binds where other hosts can reach it, and KV events name tenants, their prompts' "
        "token ids and cache salts to whoever subscribes (no authentication). Bind a loopback address "
        "(tcp://127.0.0.1:PORT, the default) and bring remote consumers in through a boundary you trust "
        "(docs/SECURITY.md), or pass allow_remote=True to bind it anyway (omit= leaves fields out)")


def node_ip(ipv6: bool = False) -> str:
    """This node's address for others to dial: ``$KVLEDGER_HOST_IP``, ``$VLLM_HOST_IP``, the
    source address of the default route (found by connecting a UDP socket: nothing is sent;
    IPv6 too when ``ipv6``), else ``127.0.0.1`` (reachable from this host only)."""
    for var in ("KVLEDGER_HOST_IP", "VLLM_HOST_IP"):
        ip = os.environ.get(var, "").strip()
        if ip:
            return ip
    routes = [(socket.AF_INET, ("8.8.8.8", 80))]
    if ipv6:
        routes.insert(0, (socket.AF_INET6, ("2001:4860:4860::8888", 80)))
    for family, target in routes:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(target)
                ip = s.getsockname()[0]
        except OSError:
            continue
        if ip and not ipaddress.ip_address(ip).is_unspecified:
            return ip
    return "127.0.0.1"


def dialable(bound: str) -> str:
    """A bound endpoint as a peer can dial it: a wildcard host (``0.0.0.0``, ``[::]``) becomes
    ``node_ip()``; anything else is returned as it is."""
    if not bound.startswith("tcp://"):
        return bound
    host, _, port = bound[6:].rpartition(":")
    if host not in _WILDCARD_HOSTS:
        return bound
    ip = node_ip(ipv6=host.startswith("[") or host == "::")
    if ":" in ip and not ip.startswith("["):
        ip = f"[{ip}]"
    return f"tcp://{ip}:{port}"
