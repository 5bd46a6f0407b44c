"""S3 clients: where every kvmesh S3 client gets its keys and its fail-fast settings (the
kvstore's shard reads and writes, the launchers that create buckets, the tests).

Shared plumbing: services import it, and so do the launchers (launch/backing/seaweed.py
runs the SeaweedFS servers these clients talk to).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field

ANY_CREDENTIALS = {"aws_access_key_id": "kvmesh", "aws_secret_access_key": "kvmesh"}


def s3_credentials(env=None) -> dict[str, str]:
    """Keys for S3 requests: $AWS_ACCESS_KEY_ID and $AWS_SECRET_ACCESS_KEY (plus
    $AWS_SESSION_TOKEN if set) when both are given, as for an external S3 (deploy/k8s's
    external overlay); else ANY_CREDENTIALS, which a SeaweedFS without IAM accepts. Never
    boto3's own search: on a machine outside a cloud its instance-metadata probe stalls."""
    env = os.environ if env is None else env
    key, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    if not (key and secret):
        return dict(ANY_CREDENTIALS)
    creds = {"aws_access_key_id": key, "aws_secret_access_key": secret}
    if env.get("AWS_SESSION_TOKEN"):
        creds["aws_session_token"] = env["AWS_SESSION_TOKEN"]
    return creds


@dataclass(frozen=True)
class S3Keys:
    """An S3 access key pair; `generate()` makes a random one (`kvmesh up`)."""

    access_key: str
    secret_key: str = field(repr=False)

    @classmethod
    def generate(cls) -> S3Keys:
        return cls("kvmesh-" + secrets.token_hex(8), secrets.token_urlsafe(30))

    def env(self) -> dict[str, str]:
        """What a kvmesh process needs in its environment to sign with these keys."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}

    def as_client_kwargs(self) -> dict[str, str]:
        return {"aws_access_key_id": self.access_key, "aws_secret_access_key": self.secret_key}


def s3_client(endpoint: str, connect_timeout: float = 1.0, read_timeout: float = 5.0,
              pool: int = 32, session=None, keys: S3Keys | None = None, **config):
    """A boto3 S3 client that fails fast: one attempt, short timeouts, path addressing.
    `session` (a boto3.Session) and extra botocore `config` keys let callers tune it;
    `keys` overrides `s3_credentials()` (the launcher, which holds the keys it made)."""
    import boto3
    from botocore.config import Config

    return (session or boto3).client(
        "s3",
        endpoint_url=endpoint,
        # Signature v4 names a region; SeaweedFS takes any, AWS the bucket's ($AWS_REGION).
        region_name=os.environ.get("AWS_REGION") or "us-east-1",
        config=Config(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"max_attempts": 1, "mode": "standard"},
            max_pool_connections=pool,
            s3={"addressing_style": "path"},
            **config,
        ),
        **(keys.as_client_kwargs() if keys else s3_credentials()),
    )


def ensure_bucket(client, bucket: str) -> None:
    try:
        client.head_bucket(Bucket=bucket)
    except Exception:  # noqa: BLE001 - absent (404) or not up; create tells which
        try:
            client.create_bucket(Bucket=bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
