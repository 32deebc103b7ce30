"""``awex-meta serve``: its options (checked: sizes above 0, a journal by default) and running it."""

from __future__ import annotations

import argparse
import logging
import math
import os

from awex.meta.errors import AwexValueError


def add_serve(parser: argparse.ArgumentParser) -> None:
    """The options of ``awex-meta serve``."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8765, help="port (default 8765; 0 picks a free one)")
    parser.add_argument("--token", default=None, help="require this bearer token (prefer --token-env)")
    parser.add_argument("--token-env", default=None, metavar="VAR", help="read the token from this env variable")
    parser.add_argument("--max-payload-mb", type=_megabytes, default=64.0, help="largest accepted body (default 64)")
    parser.add_argument(
        "--max-job-mb",
        type=_megabytes,
        default=1024.0,
        help="most one job may hold: keys, events, registrations (default 1024)",
    )
    parser.add_argument("--max-total-mb", type=_megabytes, default=4096.0, help="most all jobs may hold (default 4096)")
    parser.add_argument(
        "--max-connections",
        type=_at_least_16,
        default=16384,
        help="open connections, at most the open-file limit allows (default 16384)",
    )
    parser.add_argument(
        "--journal",
        default=None,
        metavar="PATH",
        help="file keeping fences, claimed version names and served versions across restarts (default: "
        "$AWEX_STATE_DIR or ~/.local/state/awex, meta-PORT.journal; none with --port 0)",
    )
    parser.add_argument("--no-journal", action="store_true", help="keep that state in memory only (lost on restart)")
    parser.add_argument("--journal-fsync", action="store_true", help="flush each journal record to the disk")
    parser.add_argument(
        "--store",
        default=None,
        metavar="etcd://HOST:PORT[,HOST:PORT...][/PREFIX]",
        help="keep that state in etcd instead of a journal: several servers on one etcd lead in turn (this one "
        "waits for the lead before it listens); give clients every server's address, comma-separated",
    )
    parser.add_argument(
        "--leader-ttl",
        type=int,
        default=5,
        metavar="S",
        help="with --store: seconds a dead leader keeps the lead before another server takes it (default 5)",
    )
    parser.add_argument(
        "--allow-no-token",
        action="store_true",
        help="serve on an address beyond loopback without a token (anyone who reaches the port "
        "can read and change every job)",
    )


def serve(args: argparse.Namespace) -> int:
    """Run ``awex-meta serve`` with ``args`` until interrupted; ``ValueError`` for what it cannot do."""
    from awex.meta.server.config import ServerConfig
    from awex.meta.server.embedded import serve_forever
    from awex.meta.server.journal import JournalError

    token = token_of(args, args.token)
    if not token and not _loopback(args.host):
        if not args.allow_no_token:
            raise AwexValueError(
                f"--host {args.host} without a token lets anyone who reaches the port read and change "
                "every job: pass --token-env VAR (or --allow-no-token on a trusted network)"
            )
        logging.getLogger("awex.meta.server").warning("serving on %s without a token (--allow-no-token)", args.host)
    mb = 1 << 20
    config = ServerConfig(
        token=token,
        max_payload_bytes=int(args.max_payload_mb * mb),
        max_job_bytes=int(args.max_job_mb * mb),
        max_total_bytes=int(args.max_total_mb * mb),
        max_connections=args.max_connections,
        journal=None if args.store else _journal(args),
        journal_fsync=args.journal_fsync,
        store=args.store,
        leader_ttl=args.leader_ttl,
    )
    if args.store and (args.journal or args.no_journal):
        raise AwexValueError("--store keeps the state in etcd: no --journal or --no-journal with it")
    if args.store:  # (a malformed address is refused by the store itself, before it waits for the lead)
        if not 2 <= args.leader_ttl <= 3600:
            raise AwexValueError(f"--leader-ttl {args.leader_ttl}: 2 to 3600 seconds")
    elif config.journal is None:
        logging.getLogger("awex.meta.server").warning(
            "no journal: fences and claimed version names are forgotten if this server restarts"
        )

    def started(port: int) -> None:
        print(f"awex-meta: serving on http://{args.host}:{port} (token {'required' if token else 'off'})", flush=True)

    try:
        if serve_forever(args.host, args.port, config, started=started):
            print("awex-meta: this server lost the lead on etcd and stopped (another leads now)", flush=True)
            return 3
    except JournalError as e:
        if args.store:
            raise AwexValueError(str(e)) from None
        raise AwexValueError(
            f"{e} (--journal PATH for another file, --no-journal to keep that state in memory)"
        ) from None
    except OSError as e:
        raise AwexValueError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    except KeyboardInterrupt:
        pass
    return 0


def add_client_token(parser: argparse.ArgumentParser, note: str = "") -> None:
    """A client verb's token options (``status``, ``plan --from-job``): read by :func:`client_token`."""
    parser.add_argument("--token", default=None, help=f"{note}bearer token (default: $AWEX_META_TOKEN)")
    parser.add_argument("--token-env", default=None, metavar="VAR", help="read the token from this env variable")


def client_token(args: argparse.Namespace) -> str | None:
    """The token of a client verb: ``--token-env VAR``, else ``--token``, else ``$AWEX_META_TOKEN``."""
    return token_of(args, args.token or os.environ.get("AWEX_META_TOKEN"))


def token_of(args: argparse.Namespace, default: str | None) -> str | None:
    """The token ``--token-env VAR`` names (set and not empty), else ``default``."""
    if not args.token_env:
        return default
    token = os.environ.get(args.token_env)
    if not token:
        raise AwexValueError(f"--token-env {args.token_env}: the variable is empty or unset")
    return token


def _megabytes(text: str) -> float:
    """A size in MB: a finite number above 0 (0, negative, NaN or infinite caps would refuse everything or
    nothing)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of MB") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} MB: a finite size above 0")
    return value


def _integer(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def _at_least_16(text: str) -> int:
    value = _integer(text, "a whole number")
    if value < 16:
        raise argparse.ArgumentTypeError(f"{value}: at least 16 (the server needs some to answer at all)")
    return value


def _journal(args: argparse.Namespace) -> str | None:
    """The journal ``serve`` keeps: the one given, none, or the default for its port."""
    if args.no_journal:
        if args.journal:
            raise AwexValueError("--journal and --no-journal: pick one")
        return None
    if args.journal or args.port == 0:
        return args.journal
    state = os.environ.get("AWEX_STATE_DIR") or os.path.join(os.path.expanduser("~"), ".local", "state", "awex")
    return os.path.join(state, f"meta-{args.port}.journal")


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _port(text: str) -> int:
    port = _integer(text, "a port number")
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port (0-65535; 0 picks a free one)")
    return port
