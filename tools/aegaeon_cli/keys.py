"""``aegaeon keys curve FILE``: the node's ZeroMQ CURVE certificate.

Writes ``FILE`` (the public key) and ``FILE_secret`` (public and secret key,
mode 0600) in ZeroMQ's certificate format. Every service of a node that speaks
tcp:// gets ``security.curve_key_file: FILE_secret``: its sockets encrypt, and a
bound socket accepts only peers proving they hold the same certificate. Keep the
secret file as you keep API keys (a Kubernetes Secret, a root-only file).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("keys", help="make the node's CURVE certificate for tcp:// sockets",
                            description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    kinds = parser.add_subparsers(dest="kind", required=True, metavar="KIND")
    curve = kinds.add_parser("curve", help="a ZeroMQ CURVE certificate (FILE, FILE_secret)")
    curve.add_argument("file", type=Path, help="where the public key goes")
    curve.add_argument("--force", action="store_true", help="replace existing files")
    curve.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import zmq.auth
    from aegaeon_common.usage import fail

    public = args.file.resolve()
    secret = public.with_name(public.name + "_secret")
    if not args.force and (public.exists() or secret.exists()):
        return fail("aegaeon keys", f"{public} or {secret} exists (--force replaces)")
    public.parent.mkdir(parents=True, exist_ok=True)
    made_public, made_secret = zmq.auth.create_certificates(str(public.parent), ".aegaeon-new")
    os.chmod(made_secret, 0o600)
    Path(made_secret).replace(secret)
    Path(made_public).replace(public)
    print(f"public key {public}\nsecret key {secret} (security.curve_key_file)")
    return 0
