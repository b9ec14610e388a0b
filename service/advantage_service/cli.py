"""``advantage-service``: ``serve`` the HTTP/gRPC service, or ``compute`` a JSON request file."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .version import __version__


def _compute(args: argparse.Namespace) -> int:
    from .api import compute
    from .errors import RequestError
    from .wire import jsonio

    try:
        source = sys.stdin.buffer if args.input == "-" else open(args.input, "rb")  # noqa: SIM115
    except OSError as exc:
        print(f"advantage-service: cannot read {args.input}: {exc}", file=sys.stderr)
        return 2
    with source:
        text = source.read()
    try:
        response = compute(jsonio.loads(text), device=args.device)
    except RequestError as exc:
        print(jsonio.dumps({"error": exc.to_dict()}), file=sys.stderr)
        return 1
    # (the HTTP JSON contract's formatting: float32 values in their shortest float32 repr)
    out = jsonio.dumps(response) + "\n"
    if args.output == "-":
        sys.stdout.write(out)
    else:
        with open(args.output, "w") as handle:
            handle.write(out)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .arenas import limit_arenas

    limit_arenas()  # (before the imports below start any thread)
    try:
        from .transports.server import serve
    except ImportError:
        print(
            "advantage-service: the HTTP server is not part of this build yet; "
            "use `advantage-service compute`",
            file=sys.stderr,
        )
        return 2
    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="advantage-service",
        description="Model-free per-token advantage estimation (GRPO, RLOO, KTAE, CSCR, OPSD, ...)",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    compute = sub.add_parser(
        "compute",
        help="compute a JSON request in-process",
        description="Read one request in the HTTP JSON contract (docs/http.md), compute it "
        "in this process and write the response JSON: the service's numbers and errors (a "
        "request error is printed as the HTTP error object on stderr, exit 1). KTAE history "
        "needs the service's stats store: here it is 'unavailable'.",
    )
    compute.add_argument("--input", "-i", default="-", help="request JSON file, - for stdin")
    compute.add_argument("--output", "-o", default="-", help="response JSON file, - for stdout")
    compute.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where to compute: auto (default: CUDA when available), cpu or cuda",
    )
    compute.set_defaults(run=_compute)
    serve = sub.add_parser(
        "serve",
        help="run the HTTP and gRPC service",
        description="Every setting is a flag and an ADV_* environment variable (--max-queue "
        "and ADV_MAX_QUEUE, ...); a flag overrides its variable. docs/http.md and "
        "docs/reliability.md explain them.",
    )
    serve.add_argument("--host", help="interface to listen on (default 127.0.0.1)")
    serve.add_argument("--http-port", type=int, help="HTTP port (default 8000)")
    serve.add_argument("--grpc-port", type=int, help="gRPC port (default 50051)")
    serve.add_argument("--device", help="auto (default: CUDA when available), cpu, cuda, cuda:N")
    serve.add_argument("--redis-url", help="Redis stats store (default: embedded, in memory)")
    serve.add_argument(
        "--log-level", choices=["critical", "error", "warning", "info", "debug"], help="log level"
    )
    serve.add_argument("--log-format", choices=["json", "text"], help="log lines (default json)")
    serve.add_argument("--tls-cert", help="PEM certificate chain: HTTPS and gRPC over TLS")
    serve.add_argument("--tls-key", help="PEM private key of --tls-cert")
    serve.add_argument(
        "--tls-client-ca", help="PEM CA bundle: mutual TLS, clients must present a certificate"
    )
    serve.add_argument(
        "--auth-tokens-file", help='bearer tokens, JSON {"tokens": {"<token>": ["namespace"]}}'
    )
    _add_setting_flags(serve)
    serve.set_defaults(run=_serve)
    return parser


def _add_setting_flags(serve: argparse.ArgumentParser) -> None:
    """A flag for every setting without one above (the limits, timeouts, ...), from the settings
    object itself, so the two never drift apart."""
    from .config import Settings

    taken = {action.dest for action in serve._actions}
    for name, field in Settings.model_fields.items():
        if name in taken:
            continue
        default = "unset" if field.default is None else repr(field.default).strip("'")
        serve.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            metavar=name.split("_")[-1].upper(),
            help=f"{field.description or name} (ADV_{name.upper()}; default {default})",
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
