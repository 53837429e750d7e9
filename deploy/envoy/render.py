"""Render deploy/envoy/envoy.yaml.tmpl: the Envoy config of a gateway in front of
`prefixd picker`. One renderer for deploy/gateway-local.sh (run as a script) and the tests
(tests/envoy_fixtures.py imports it); standard library only, so it runs without prefixd.

    python deploy/envoy/render.py --listen 127.0.0.1:8080 --picker 127.0.0.1:9002 \\
        --pool 127.0.0.2:8000 --pool 127.0.0.3:8000 [--fail-open] [--admin 127.0.0.1:9901]
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys
from pathlib import Path
from string import Template

TEMPLATE = Path(__file__).resolve().parent / "envoy.yaml.tmpl"


def split_address(address: str) -> tuple[str, int]:
    """'ip:port' or '[ipv6]:port' as (ip, port); ValueError unless an IP literal and a port
    (Envoy's STATIC clusters and the pick's header name endpoints by IP, never by name)."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{address!r}: expected ip:port")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    ipaddress.ip_address(host)   # ValueError: not an IP literal
    return host, int(port)


def _socket(address: str) -> dict:
    host, port = split_address(address)
    return {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}


def render(listen: str, picker: str, pool: list[str], *, fail_open: bool = False,
           admin: str | None = None, message_timeout_s: int = 600, idle_timeout_s: int = 3600,
           retries: int = 2, body_buffer_bytes: int = 32 * 2**20,
           subset_header: str | None = None) -> str:
    """The config as YAML text. `listen`, `picker`, each of `pool` and `admin` are ip:port (port
    0: any free one, for tests); `pool` is every endpoint the picker may pick (the picker's
    endpoints file lists the same): a pick outside it, or none, is served round robin over it.
    `fail_open`: a request is served when the picker cannot be reached (else: 500). `admin`:
    Envoy's admin interface, None for none (it has no authentication: keep it on loopback).
    `idle_timeout_s`: a request with no byte either way for that long is ended (0: never);
    `retries`: further endpoints of the pick's list tried when one refuses the connection, for
    a body of at most `body_buffer_bytes` (prefixd's own limit, max_body_bytes, by default).
    `subset_header`: a request header whose value (ip:port[,...]) becomes the subset hint
    (`envoy.lb.subset_hint` metadata: the picker picks only from it), as a Gateway API
    implementation sets it; None: none (the hint comes only from Envoy's own filters)."""
    if not pool:
        raise ValueError("the pool needs at least one endpoint")
    listen_host, listen_port = split_address(listen)
    admin_block = ""
    if admin is not None:
        admin_host, admin_port = split_address(admin)
        admin_block = (f"admin:\n  address: {{socket_address: {{address: {admin_host}, "
                       f"port_value: {admin_port}}}}}")
    return Template(TEMPLATE.read_text()).substitute(
        admin=admin_block, listen_host=listen_host, listen_port=listen_port,
        picker_endpoint=json.dumps(_socket(picker)),
        pool_endpoints=json.dumps([_socket(a) for a in pool]),
        failure_mode_allow="true" if fail_open else "false",
        message_timeout_s=int(message_timeout_s), idle_timeout_s=int(idle_timeout_s),
        retries=int(retries), body_buffer_bytes=int(body_buffer_bytes),
        subset_filter=_subset_filter(subset_header) if subset_header else "")


def _subset_filter(header: str) -> str:
    """A header-to-metadata filter: `header`'s value as the subset hint (then removed)."""
    rule = {"header": header, "remove": True, "on_header_present": {
        "metadata_namespace": "envoy.lb.subset_hint",
        "key": "x-gateway-destination-endpoint-subset", "type": "STRING"}}
    config = {"@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata"
                       ".v3.Config", "request_rules": [rule]}
    return ("\n          - name: envoy.filters.http.header_to_metadata\n"
            f"            typed_config: {json.dumps(config)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", default="127.0.0.1:8080", help="ip:port of the gateway")
    p.add_argument("--picker", default="127.0.0.1:9002", help="ip:port of prefixd picker")
    p.add_argument("--pool", action="append", required=True,
                   help="ip:port of a model server the picker picks from (repeat)")
    p.add_argument("--fail-open", action="store_true",
                   help="serve (round robin) when the picker is down, instead of a 500")
    p.add_argument("--admin", default=None, help="ip:port of Envoy's admin (default: none)")
    p.add_argument("--idle-timeout", type=int, default=3600,
                   help="seconds a request may pass with no byte either way (0: no limit)")
    args = p.parse_args(argv)
    try:
        sys.stdout.write(render(args.listen, args.picker, args.pool, fail_open=args.fail_open,
                                admin=args.admin, idle_timeout_s=args.idle_timeout))
    except ValueError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
