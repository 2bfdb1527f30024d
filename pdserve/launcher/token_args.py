"""The cluster token flag of the commands that join a running cluster (`pdserve worker`,
`pdserve router`): where the token comes from, and reading it."""

from __future__ import annotations

import argparse


def add_cluster_token_arg(p: argparse.ArgumentParser) -> None:
    from pdserve.proto.auth import TOKEN_ENV

    p.add_argument("--cluster-token-file", default=None, metavar="FILE",
                   help=f"file holding the cluster token that every call between router and workers carries "
                        f"(default: ${TOKEN_ENV}; `pdserve up` makes its own)")


def cluster_token(args: argparse.Namespace) -> str | None:
    """The token of `--cluster-token-file`, else of the environment variable; None when neither
    is set. ValueError naming the flag or the variable when the token is unreadable or malformed."""
    from pdserve.proto.auth import resolve_token

    return resolve_token(args.cluster_token_file)
