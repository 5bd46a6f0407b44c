"""docker-compose.yml agrees with the code: real commands, matching ports, known env vars.

No Docker daemon is needed: the file is parsed and each command is parsed by the
same argparse parser `kvmesh` uses.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kvmesh.launch.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
KVMESH_SERVICES = [n for n, s in SERVICES.items() if s.get("command", [None])[0] == "kvmesh"]
# Ports the third-party images listen on with the commands used in the file.
IMAGE_PORTS = {"redis": {6379}, "s3": {8333}}
SOURCE = "\n".join(p.read_text() for d in ("kvmesh", "services", "launch") for p in (ROOT / d).rglob("*.py"))


def container_ports(service: dict) -> set[int]:
    return {int(str(p).split(":")[-1].split("/")[0]) for p in service.get("ports", [])}


def parse(name: str):
    return build_parser().parse_args(SERVICES[name]["command"][1:])


def test_expected_services_present():
    assert {"redis", "s3", "kvstore", "directory", "engine-a", "engine-b", "gateway"} <= set(SERVICES)


@pytest.mark.parametrize("name", KVMESH_SERVICES)
def test_command_is_a_real_kvmesh_serve_command(name):
    cmd = SERVICES[name]["command"]
    assert cmd[2] == "serve", cmd
    args = parse(name)
    assert callable(args.func)


@pytest.mark.parametrize("name", KVMESH_SERVICES)
def test_published_ports_are_the_ports_the_command_uses(name):
    args = parse(name)
    env = SERVICES[name].get("environment", {})
    used = {args.port} | {int(v) for k, v in env.items() if k.endswith("_PORT")}
    if getattr(args, "metrics_port", None):
        used.add(args.metrics_port)
    published = container_ports(SERVICES[name])
    assert args.port in published and published <= used, (published, used)
    assert args.host == "0.0.0.0"  # reachable from other containers
    health = SERVICES[name]["healthcheck"]["test"]
    gateway = args.command == "gateway"
    # a gateway's public port is plaintext under the mesh's TLS: checked with --public
    assert health[4:] == [f"localhost:{args.port}", *(["--public"] if gateway else [])], health


@pytest.mark.parametrize("name", ["gateway", "gateway-pd"])
def test_gateway_config_resolves_to_published_ports(name):
    from kvmesh.services.gateway.cli import config_from_args
    from kvmesh.services.gateway.config import GatewayConfig, split_addresses

    svc = SERVICES[name]
    args = parse(name)
    cfg = config_from_args(args)  # flags only; env comes from the file below
    cfg = GatewayConfig.from_env({k: str(v) for k, v in svc["environment"].items()},
                                 **{k: getattr(cfg, k) for k in (
                                     "host", "port", "engines", "directory", "prefill_engines",
                                     "decode_engines")})
    assert {cfg.port, cfg.metrics_port, cfg.http_port} == container_ports(svc)
    assert cfg.http_port
    pd = split_addresses(cfg.prefill_engines) + split_addresses(cfg.decode_engines)
    for addr in cfg.engine_list + pd + ((cfg.directory,) if cfg.directory else ()):
        host, _, port = addr.rpartition(":")
        assert int(port) in container_ports(SERVICES[host]), addr


def test_pd_profile_runs_one_prefill_and_two_decode_engines():
    from kvmesh.services.gateway.cli import config_from_args
    from kvmesh.services.gateway.config import split_addresses

    pd = {n for n, s in SERVICES.items() if "pd" in s.get("profiles", [])}
    assert pd == {"pd-prefill", "pd-decode-a", "pd-decode-b", "gateway-pd"}
    roles = {n: parse(n).role for n in pd - {"gateway-pd"}}
    assert roles == {"pd-prefill": "prefill", "pd-decode-a": "decode", "pd-decode-b": "decode"}
    cfg = config_from_args(parse("gateway-pd"))
    assert split_addresses(cfg.prefill_engines) == ("pd-prefill:7211",)
    assert split_addresses(cfg.decode_engines) == ("pd-decode-a:7212", "pd-decode-b:7213")
    # the default profile is unchanged: no role flags there
    assert all(parse(n).role == "unified" for n in ("engine-a", "engine-b"))


def test_deepseek_v4_profile_serves_the_mounted_checkpoint():
    v4 = {n for n, s in SERVICES.items() if "deepseek-v4" in s.get("profiles", [])}
    assert v4 == {"v4-engine-a", "v4-engine-b", "gateway-v4"}
    for name in v4:
        (mount,) = SERVICES[name]["volumes"]
        assert mount.endswith(":/model:ro"), mount
    assert all(parse(n).model == "/model" for n in ("v4-engine-a", "v4-engine-b"))
    assert parse("gateway-v4").tokenizer == "/model/tokenizer.json"
    assert parse("gateway-v4").engines == "v4-engine-a:7221,v4-engine-b:7222"
    assert all(parse(n).model == "/app/models/deepseek-v41-tiny" for n in ("engine-a", "engine-b"))


def test_the_other_engines_serve_the_shipped_model_and_gateways_its_tokenizer():
    from tests.k8s_env import check_serves_the_shipped_model

    engines = [n for n in KVMESH_SERVICES if SERVICES[n]["command"][1] == "engine"
               and "deepseek-v4" not in SERVICES[n].get("profiles", [])]
    assert set(engines) >= {"engine-a", "engine-b", "pd-prefill", "pd-decode-a"}
    for name in engines:
        args = parse(name)
        check_serves_the_shipped_model(args)      # under its truncation flags
        assert (args.truncation, args.keep_tokens) == ("compact", 134), name
    for name in ("gateway", "gateway-pd"):
        assert parse(name).tokenizer == "/app/models/deepseek-v41-tiny/tokenizer.json"
    dockerfile = (ROOT / "Dockerfile").read_text()   # where the image keeps that path
    assert "WORKDIR /app" in dockerfile and "COPY models models" in dockerfile


@pytest.mark.parametrize("name", sorted(IMAGE_PORTS))
def test_image_services_publish_their_ports(name):
    assert container_ports(SERVICES[name]) == IMAGE_PORTS[name]


def test_every_kvmesh_env_var_is_read_by_the_code():
    names = set(re.findall(r"\bKVMESH_[A-Z0-9_]+", (ROOT / "docker-compose.yml").read_text()))
    assert names, "expected some KVMESH_* settings in the compose file"
    unknown = sorted(n for n in names if n not in SOURCE)
    assert not unknown, f"not read anywhere in kvmesh/ or services/: {unknown}"


def test_dependencies_exist():
    for name, svc in SERVICES.items():
        deps = svc.get("depends_on", [])
        for dep in deps if isinstance(deps, list) else deps.keys():
            assert dep in SERVICES, f"{name} depends on unknown service {dep}"


def test_dockerfile_builds_cpu_image():
    text = (ROOT / "Dockerfile").read_text()
    assert text.startswith("# ") and "FROM python:3.11-slim" in text
    assert "torch==2.13.0" in text and "whl/cpu" in text and "pip install ." in text
    for name in KVMESH_SERVICES:
        assert SERVICES[name]["build"] == "."


# -- backing-server credentials (docs/deployment/security.md, "Backing-server credentials")
SECRETS = {"REDIS_PASSWORD": "pw-1", "S3_ACCESS_KEY": "ak-2", "S3_SECRET_KEY": "sk-3",
           "KVMESH_SERVICE_TOKEN": "tok-4", "KVMESH_ADMIN_TOKEN": "adm-5",
           "SEAWEED_JWT_KEY": "jwt-6"}


# settings that are not secrets: the deepseek-v4 profile's checkpoint directory
SETTINGS = {"DEEPSEEK_V4_DIR"}


def interpolate(text: str) -> str:
    """Compose's ${VAR} / ${VAR:?message} substitution with SECRETS."""
    return re.sub(r"\$\{(\w+)(:\?[^}]*)?\}", lambda m: SECRETS[m.group(1)], text)


def test_credentials_come_from_the_environment_and_are_required():
    text = (ROOT / "docker-compose.yml").read_text()
    used = set(re.findall(r"\$\{(\w+)", text))
    assert used == set(SECRETS) | set(SETTINGS)
    for name in SETTINGS:  # not a secret: a default keeps the other profiles starting
        assert re.search(r"\$\{" + name + r":-", text), name
    for name in SECRETS:  # compose refuses to start without each one
        assert re.search(r"\$\{" + name + r":\?", text), name
    assert "scripts/backing_secrets.py" in text
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(ROOT / "scripts/backing_secrets.py")],
                         capture_output=True, text=True, check=True).stdout
    made = dict(line.split("=", 1) for line in out.splitlines())
    assert set(made) == set(SECRETS) and all(len(v) >= 16 for v in made.values())


def test_redis_runs_with_the_acl_kvmesh_writes():
    from kvmesh.launch.backing.valkey import acl_config

    conf = interpolate(COMPOSE["configs"]["redis-acl"]["content"])
    assert conf == acl_config("kvmesh", SECRETS["REDIS_PASSWORD"])
    redis = SERVICES["redis"]
    [mount] = redis["configs"]
    assert redis["command"][:2] == ["redis-server", mount["target"]]
    assert mount["source"] == "redis-acl"
    assert "--user kvmesh" in redis["healthcheck"]["test"][1]
    env = SERVICES["directory"]["environment"]
    assert env["KVMESH_DIRECTORY_REDIS_USERNAME"] == "kvmesh"
    assert interpolate(env["KVMESH_DIRECTORY_REDIS_PASSWORD"]) == SECRETS["REDIS_PASSWORD"]


def test_s3_runs_with_the_identities_kvmesh_writes(tmp_path):
    import json

    from kvmesh.launch.backing.seaweed import write_identity_config
    from kvmesh.s3 import S3Keys

    keys = S3Keys(SECRETS["S3_ACCESS_KEY"], SECRETS["S3_SECRET_KEY"])
    want = json.loads(write_identity_config(tmp_path / "s3.json", keys).read_text())
    assert json.loads(interpolate(COMPOSE["configs"]["s3-identities"]["content"])) == want
    s3 = SERVICES["s3"]
    [mount] = [m for m in s3["configs"] if m["source"] == "s3-identities"]
    assert f"-s3.config={mount['target']}" in s3["command"]
    env = SERVICES["kvstore"]["environment"]
    assert {k: interpolate(env[k]) for k in keys.env()} == keys.env()


def test_s3_runs_with_the_security_config_kvmesh_writes():
    """weed's filer and volume servers want JWTs: the same security.toml `kvmesh up`
    writes (kvmesh.launch.backing.seaweed.security_config), at a path weed reads."""
    import tomllib

    from kvmesh.launch.backing.seaweed import security_config

    got = interpolate(COMPOSE["configs"]["seaweed-security"]["content"])
    assert tomllib.loads(got) == tomllib.loads(security_config(SECRETS["SEAWEED_JWT_KEY"]))
    targets = {m["source"]: m["target"] for m in SERVICES["s3"]["configs"]}
    assert targets["seaweed-security"] == "/etc/seaweedfs/security.toml"
    assert "-disableHttp" in SERVICES["s3"]["command"]       # as SeaweedServer.argv runs it


def test_every_service_runs_mutual_tls_with_the_certificate_backing_secrets_makes(tmp_path):
    """As under `kvmesh up`: every kvmesh container has the CA, the certificate and its key
    (compose secrets), gateways keep their public ports plaintext, and the certificate
    `backing_secrets.py --tls` writes names every service another one dials."""
    import subprocess
    import sys

    from cryptography import x509

    names = {"KVMESH_TLS_CA": "kvmesh-tls-ca", "KVMESH_TLS_CERT": "kvmesh-tls-cert",
             "KVMESH_TLS_KEY": "kvmesh-tls-key"}
    files = {"kvmesh-tls-ca": "./tls/ca.pem", "kvmesh-tls-cert": "./tls/mesh.pem",
             "kvmesh-tls-key": "./tls/mesh.key"}
    assert {k: v["file"] for k, v in COMPOSE["secrets"].items()} == files
    for name in KVMESH_SERVICES:
        svc = SERVICES[name]
        env = svc["environment"]
        assert {k: env[k] for k in names} == {k: f"/run/secrets/{v}" for k, v in names.items()}
        assert sorted(svc["secrets"]) == sorted(files), name
        assert (env.get("KVMESH_TLS_PUBLIC") == "off") == (svc["command"][1] == "gateway"), name
    subprocess.run([sys.executable, str(ROOT / "scripts/backing_secrets.py"), "--tls",
                    str(tmp_path / "tls")], check=True, timeout=60)
    cert = x509.load_pem_x509_certificate((tmp_path / "tls" / "mesh.pem").read_bytes())
    dns = set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
              .value.get_values_for_type(x509.DNSName))
    dialled = set()
    for name in KVMESH_SERVICES:
        for arg in SERVICES[name]["command"]:
            dialled |= {a.split(":")[0] for a in arg.split(",") if re.fullmatch(r"[a-z][\w-]*:\d+", a)}
    assert dialled and dialled <= dns, dialled - dns
    assert set(KVMESH_SERVICES) <= dns
    assert (tmp_path / "tls").stat().st_mode & 0o777 == 0o700


def test_each_credential_reaches_only_the_containers_that_use_it():
    where = {name: {n for n, svc in SERVICES.items()
                    if "${" + name in yaml.safe_dump(svc.get("environment", {}))}
             for name in ("REDIS_PASSWORD", "S3_ACCESS_KEY", "S3_SECRET_KEY",
                          "KVMESH_ADMIN_TOKEN")}
    kv = {"kvstore", "kvstore-b"}  # replicas on the shared index in Redis
    assert where == {"REDIS_PASSWORD": {"redis", "directory"} | kv, "S3_ACCESS_KEY": kv,
                     "S3_SECRET_KEY": kv, "KVMESH_ADMIN_TOKEN": kv}


def test_every_port_is_published_on_loopback_only():
    for name, svc in SERVICES.items():
        for p in svc.get("ports", []):
            assert str(p).startswith("127.0.0.1:"), (name, p)


def test_every_public_gateway_has_keys_or_is_allowed_without():
    """A gateway on the container's 0.0.0.0 without keys refuses to start unless allowed."""
    from kvmesh.auth import check_public_bind
    from kvmesh.services.gateway.cli import config_from_args
    from kvmesh.services.gateway.config import GatewayConfig

    gateways = [n for n in KVMESH_SERVICES if SERVICES[n]["command"][1] == "gateway"]
    assert len(gateways) >= 1
    for name in gateways:
        flags = config_from_args(parse(name))
        env = {k: str(v) for k, v in SERVICES[name].get("environment", {}).items()}
        cfg = GatewayConfig.from_env(env, host=flags.host)
        check_public_bind(cfg.host, bool(cfg.api_keys), cfg.allow_unauthenticated)
