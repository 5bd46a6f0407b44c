"""Print fresh random credentials for the backing servers, as `kvmesh up` makes per run:

    python3 scripts/backing_secrets.py > .env                 # docker-compose.yml
    python3 scripts/backing_secrets.py --tls tls              # its CA and certificate
    python3 scripts/backing_secrets.py --k8s > backing.env     # deploy/k8s/overlays/bundled
    python3 scripts/backing_secrets.py --k8s-token service > service-token.env   # deploy/k8s
    python3 scripts/backing_secrets.py --k8s-token admin > admin-token.env
    python3 scripts/backing_secrets.py --k8s-tls tls-k8s       # the kvmesh-tls Secret's files

Compose: REDIS_PASSWORD (the Redis ACL user `kvmesh`, used by the directory),
S3_ACCESS_KEY/S3_SECRET_KEY (SeaweedFS's one S3 identity, used by the kvstore),
KVMESH_SERVICE_TOKEN (every internal RPC), KVMESH_ADMIN_TOKEN (the kvstore's admin
RPCs: `docker compose exec kvstore kvmesh admin ...`) and SEAWEED_JWT_KEY (the key of
SeaweedFS's filer and volume JWTs; Kubernetes derives it from the S3 secret instead). --k8s: the keys of the `kvmesh-backing`
Secret under the names the containers read (backing.env.example beside the overlay).
--tls DIR writes ca.pem, mesh.pem and mesh.key (kvmesh/run_ca.py): one certificate naming every
compose service (COMPOSE_HOSTS), for mutual TLS between them as under `kvmesh up`. DIR is 0700;
the key is 0644 inside it because compose mounts the file as it is into containers that run
as uid 10001 (the directory keeps other host users out).
--k8s-tls DIR writes the same three files for deploy/k8s: one certificate naming only
"kvmesh", the name every client checks servers against there (KVMESH_TLS_SERVER_NAME: pods
are dialled at their IPs); the key stays 0600 (the Secret's mount sets the mode in the pod).
Keep the output private (both file names are git-ignored); running this again replaces
every credential.
"""

import argparse
import secrets
import sys

# every name a compose service dials another by (tests/gateway/test_compose.py checks it)
COMPOSE_HOSTS = ("kvstore", "kvstore-b", "directory", "engine-a", "engine-b", "gateway",
                 "pd-prefill", "pd-decode-a", "pd-decode-b", "gateway-pd", "v4-engine-a",
                 "v4-engine-b", "gateway-v4")


# the one name a kvmesh certificate has in Kubernetes (deploy/k8s/base/config.yaml)
K8S_SERVER_NAME = "kvmesh"


def write_tls(directory: str, hosts: tuple[str, ...] = COMPOSE_HOSTS, key_mode: int = 0o644):
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kvmesh.run_ca import make_run_ca

    files = make_run_ca(Path(directory), hosts, days=3650)
    Path(files.key).chmod(key_mode)
    return files


def credentials() -> dict[str, str]:
    return {"redis": secrets.token_urlsafe(30), "s3_key": f"kvmesh-{secrets.token_hex(8)}",
            "s3_secret": secrets.token_urlsafe(30), "service": secrets.token_urlsafe(32),
            "admin": secrets.token_urlsafe(32), "seaweed_jwt": secrets.token_urlsafe(32)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k8s", action="store_true", help="the kvmesh-backing Secret's keys")
    ap.add_argument("--k8s-token", choices=["service", "admin"], default=None,
                    help="the kvmesh-service-token or kvmesh-admin-token Secret's one key "
                    "(default: none)")
    ap.add_argument("--tls", metavar="DIR", default=None,
                    help="write the compose services' CA and certificate into DIR instead "
                    "(default: none)")
    ap.add_argument("--k8s-tls", metavar="DIR", default=None,
                    help="write deploy/k8s's CA and certificate (naming 'kvmesh') into DIR "
                    "instead (default: none)")
    args = ap.parse_args()
    if args.tls:
        write_tls(args.tls)
        raise SystemExit(0)
    if args.k8s_tls:
        write_tls(args.k8s_tls, (K8S_SERVER_NAME,), 0o600)
        raise SystemExit(0)
    c = credentials()
    if args.k8s_token:
        print(f"KVMESH_{args.k8s_token.upper()}_TOKEN={c[args.k8s_token]}")
        raise SystemExit(0)
    names = (("KVMESH_DIRECTORY_REDIS_PASSWORD", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
             if args.k8s else
             ("REDIS_PASSWORD", "S3_ACCESS_KEY", "S3_SECRET_KEY", "KVMESH_SERVICE_TOKEN",
              "KVMESH_ADMIN_TOKEN", "SEAWEED_JWT_KEY"))
    values = (c["redis"], c["s3_key"], c["s3_secret"], c["service"], c["admin"], c["seaweed_jwt"])
    for name, value in zip(names, values, strict=False):  # --k8s: tokens by --k8s-token
        print(f"{name}={value}")
