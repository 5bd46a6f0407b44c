"""deploy/k8s agrees with Kubernetes and with the code: schemas, commands, ports, env, drain.

Each overlay is rendered by tests/kustomize.py (no kubectl here) and every resource is
validated offline (strict: unknown fields fail) by kubernetes-validate. Then, as
tests/gateway/test_compose.py does for docker-compose.yml, every kvmesh command is
parsed by the real `kvmesh` argparse parser, the resulting configs are built from the
rendered environment by the services' own config classes, and every port, address,
variable and shutdown budget is checked against what the code does. The bundled
Valkey and SeaweedFS commands are run for real in tests/test_k8s_bundled.py.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.k8s_env import (
    ENV_EXAMPLE,
    FIELD_VALUES,
    ROOT,
    check_serves_the_shipped_model,
    container_env,
    grpc_port,
    main_container,
    memory_bytes,
    named_port,
    parse,
    quantity,
    rendered,
    selected,
    services,
    use_env,
    workload,
)
from tests.kustomize import render

OVERLAYS = ["bundled", "external", "deepseek-v4", "split"]
SERVICES = ["gateway", "engine", "directory", "kvstore"]
# Oldest Kubernetes the manifests target (native gRPC probes are GA since 1.27) and newest.
K8S_VERSIONS = ["1.30.0", kubernetes_validate.utils.latest_version()]
SOURCE = "\n".join(p.read_text() for d in ("kvmesh", "services", "launch") for p in (ROOT / d).rglob("*.py"))


# -- schemas ---------------------------------------------------------------------------
@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_resource_passes_the_kubernetes_schema(overlay, version):
    for r in rendered(overlay):
        kubernetes_validate.validate(r, version, strict=True)


def test_overlays_hold_the_expected_resources():
    kinds = {(r["kind"], r["metadata"]["name"]) for r in rendered("external")}
    want = {("Deployment", "gateway"), ("Deployment", "engine"), ("Deployment", "directory"),
            ("StatefulSet", "kvstore"), ("ConfigMap", "kvmesh-config"), ("Namespace", "kvmesh")}
    want |= {("Service", s) for s in SERVICES} | {("PodDisruptionBudget", s) for s in SERVICES}
    assert want <= kinds
    bundled = {(r["kind"], r["metadata"]["name"]) for r in rendered("bundled")}
    assert want | {("Deployment", "valkey"), ("StatefulSet", "seaweedfs"),
                   ("Service", "valkey"), ("Service", "seaweedfs")} == bundled
    for overlay in OVERLAYS:
        for r in rendered(overlay):
            if r["kind"] != "Namespace":
                assert r["metadata"]["namespace"] == "kvmesh", r["metadata"]


# -- commands and ports ----------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("name", SERVICES)
def test_command_is_a_real_serve_command_on_the_declared_ports(overlay, name):
    res = rendered(overlay)
    args = parse(res, name)
    assert callable(args.func) and args.host == "0.0.0.0"
    w = workload(res, name)
    c = main_container(w)
    assert named_port(c, "grpc") == args.port
    # a TLS port (every one but the gateway's public port) is probed on its plaintext
    # health-only port (KVMESH_TLS_HEALTH_PORT); a TCP probe may go to the port itself
    env = container_env(res, c)
    health = args.port if name == "gateway" else int(env["KVMESH_TLS_HEALTH_PORT"])
    if name != "gateway":
        assert named_port(c, "health") == health and env["KVMESH_TLS_CERT"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        if probe in c:
            want = args.port if "tcpSocket" in c[probe] else health
            assert grpc_port(c[probe]) == want, (probe, c[probe])
    assert "grpc" in c["readinessProbe"], "readiness follows the service's gRPC health"
    metrics = args.metrics_port
    if name == "gateway":
        metrics = int(container_env(res, c)["KVMESH_GATEWAY_METRICS_PORT"])
    assert metrics == named_port(c, "metrics")
    assert w["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(metrics)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_port_reaches_a_container_port(overlay):
    res = rendered(overlay)
    for name, svc in services(res).items():
        [w] = selected(res, svc["spec"]["selector"])
        c = main_container(w)
        for p in svc["spec"]["ports"]:
            target = p["targetPort"]
            port = named_port(c, target) if isinstance(target, str) else target
            assert port == p["port"], (name, p)
        if w["kind"] == "StatefulSet":
            assert w["spec"]["serviceName"] == name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_address_in_commands_and_config_is_a_service_port(overlay):
    res = rendered(overlay)
    env = container_env(res, main_container(workload(res, "kvstore")))
    engine, gateway = parse(res, "engine"), parse(res, "gateway")
    addresses = [engine.directory, engine.kvstore, gateway.directory,
                 env["KVMESH_GATEWAY_ADDR"], env["KVMESH_KVSTORE_ADDR"]]
    if overlay == "bundled":
        addresses.append(env["KVMESH_DIRECTORY_REDIS_URL"].split("//")[1].split("/")[0])
        addresses += {loc.split("//")[1].split("/")[0]
                      for loc in env["KVMESH_KVSTORE_LOCATIONS"].split(",")}
    svcs = services(res)
    for addr in addresses:
        host, _, port = addr.rpartition(":")
        assert host in svcs, f"{addr}: no Service {host!r}"
        assert int(port) in {p["port"] for p in svcs[host]["spec"]["ports"]}, addr


def test_engines_register_their_own_pod_address():
    res = rendered("bundled")
    c = main_container(workload(res, "engine"))
    raw = c["args"]
    assert raw[raw.index("--advertise") + 1] == "$(POD_IP):" + str(named_port(c, "grpc"))
    assert raw[raw.index("--engine-id") + 1] == "$(POD_NAME)"
    args = parse(res, "engine")
    assert args.advertise == f"{FIELD_VALUES['status.podIP']}:{args.port}"
    assert args.engine_id == FIELD_VALUES["metadata.name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_variable_reference_is_defined_before_use(overlay):
    for w in (r for r in rendered(overlay) if r["kind"] in ("Deployment", "StatefulSet")):
        c = main_container(w)
        defined = {e["name"] for e in c.get("env", [])}
        for arg in c.get("args", []):
            for ref in re.findall(r"\$\((\w+)\)", arg):
                assert ref in defined, f"{w['metadata']['name']}: $({ref}) not in env"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_add_to_the_base_and_drop_nothing(overlay):
    """A JSON patch `add .../env` replaces a list that exists: base settings must survive."""
    base = {(r["kind"], r["metadata"]["name"]): r for r in render(ROOT / "deploy/k8s/base")}
    for r in rendered(overlay):
        if (r["kind"], r["metadata"]["name"]) not in base or r["kind"] == "Namespace":
            continue
        b = base[(r["kind"], r["metadata"]["name"])]
        assert b.get("data", {}).items() <= r.get("data", {}).items()
        if r["kind"] in ("Deployment", "StatefulSet"):
            bc, rc = main_container(b), main_container(r)
            for key in ("env", "envFrom", "ports", "volumeMounts"):
                assert all(item in rc.get(key, []) for item in bc.get(key, [])), key
            assert rc["args"][:len(bc["args"])] == bc["args"]


# -- environment -----------------------------------------------------------------------
def known_env_names() -> set[str]:
    """Every KVMESH_* name the code reads: config dataclass fields under their prefix,
    and names quoted in source (kvmesh/envs.py, client addresses)."""
    import dataclasses

    from kvmesh.services.directory.config import ENV_PREFIX as DIR
    from kvmesh.services.directory.config import DirectoryConfig
    from kvmesh.services.gateway.config import ENV_PREFIX as GW
    from kvmesh.services.gateway.config import GatewayConfig
    from kvmesh.services.kvstore.config import ENV_PREFIX as KV
    from kvmesh.services.kvstore.config import KvstoreConfig

    names = set(re.findall(r"[\"'](KVMESH_[A-Z0-9_]+)[\"']", SOURCE))
    for prefix, cls in ((GW, GatewayConfig), (DIR, DirectoryConfig), (KV, KvstoreConfig)):
        names |= {prefix + f.name.upper() for f in dataclasses.fields(cls) if f.name != "layout"}
    return names


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_variable_in_the_manifests_is_read_by_the_code(overlay):
    text = yaml.safe_dump_all(rendered(overlay)) + ENV_EXAMPLE.read_text()
    names = set(re.findall(r"\bKVMESH_[A-Z0-9_]+", text))
    assert {"KVMESH_KVSTORE_LOCATIONS", "KVMESH_GATEWAY_METRICS_PORT"} <= names
    assert not sorted(names - known_env_names())
    for other in set(re.findall(r"\bAWS_[A-Z_]+", text)):
        assert f'"{other}"' in SOURCE, f"{other} is not read anywhere"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_configs_build_from_the_rendered_environment(overlay, monkeypatch):
    from kvmesh.services.directory.cli import config_from_args as directory_config
    from kvmesh.services.engine.build import engine_config
    from kvmesh.services.engine.core.model_paths import refuse_unsupported
    from kvmesh.services.gateway.cli import config_from_args as gateway_config
    from kvmesh.services.kvstore.config import KvstoreConfig

    res = rendered(overlay)
    env = {k: v for n in SERVICES
           for k, v in container_env(res, main_container(workload(res, n))).items()}
    use_env(monkeypatch, env)
    gw = gateway_config(parse(res, "gateway"))
    assert (gw.port, gw.metrics_port, gw.directory) == (7000, 9100, "directory:50070")
    d = directory_config(parse(res, "directory"))
    assert d.redis_url == env["KVMESH_DIRECTORY_REDIS_URL"]
    engine = parse(res, "engine")
    ecfg = engine_config(engine)
    # the shipped model's setting; a DeepSeek V4 engine turns it off by flag (and starts)
    assert ecfg.truncation == ("off" if overlay == "deepseek-v4" else "compact")
    assert ecfg.keep_tokens == 134
    if overlay == "deepseek-v4":
        refuse_unsupported(ecfg)
    else:
        check_serves_the_shipped_model(engine)   # KEEP >= W + B for its window

    args = parse(res, "kvstore")
    kv = KvstoreConfig.from_env(host=args.host, port=args.port, locations=args.locations,
                                data_dir=args.data_dir, mem_bytes=args.mem_bytes,
                                disk_bytes=args.disk_bytes)
    assert len(kv.locations) == kv.layout.n == 12
    w = workload(res, "kvstore")
    c = main_container(w)
    [mount] = [m for m in c["volumeMounts"] if m["name"] != "tls"]
    [claim] = w["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == mount["name"]
    assert kv.data_dir.is_relative_to(mount["mountPath"])
    # The disk tier fits its volume with room for the index; the memory tier its request.
    assert kv.disk_bytes <= 0.9 * quantity(claim["spec"]["resources"]["requests"]["storage"])
    assert kv.mem_bytes <= memory_bytes(c["resources"]["requests"]["memory"]) / 2
    if overlay == "external":  # one lost S3 server must not lose objects: <= m per server
        per_server: dict[str, int] = {}
        for loc in kv.locations:
            per_server[loc.endpoint] = per_server.get(loc.endpoint, 0) + 1
        assert max(per_server.values()) <= kv.layout.m, per_server


def test_external_credentials_reach_the_s3_client(monkeypatch):
    from kvmesh.s3 import ANY_CREDENTIALS, s3_client

    res = rendered("external")
    env = container_env(res, main_container(workload(res, "kvstore")))
    assert env["AWS_ACCESS_KEY_ID"] == "CHANGE-ME"  # from backing.env.example via the Secret
    use_env(monkeypatch, {"AWS_ACCESS_KEY_ID": "AKIDEXAMPLE",
                          "AWS_SECRET_ACCESS_KEY": "s3cr3t", "AWS_REGION": env["AWS_REGION"]})
    client = s3_client("http://127.0.0.1:9")
    creds = client._request_signer._credentials
    assert (creds.access_key, creds.secret_key) == ("AKIDEXAMPLE", "s3cr3t")
    assert client.meta.region_name == env["AWS_REGION"]
    use_env(monkeypatch, {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""})
    creds = s3_client("http://127.0.0.1:9")._request_signer._credentials
    assert creds.access_key == ANY_CREDENTIALS["aws_access_key_id"]  # bundled SeaweedFS


# -- lifecycle -------------------------------------------------------------------------
# Where each service's SIGTERM path sets its grace for in-flight calls.
DRAIN_CODE = {"gateway": "services/gateway/service.py", "engine": "services/engine/rpc/server.py",
              "kvstore": "services/kvstore/server.py", "directory": "services/directory/service.py"}


def drain_grace_s(path: str) -> float:
    """The largest `grace` in the file: a `grace=` argument or a `grace` default."""
    values = []
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, ast.keyword) and node.arg == "grace":
            values.append(node.value.value)
        if isinstance(node, ast.arguments):
            named = node.args[len(node.args) - len(node.defaults):]
            values += [d.value for a, d in zip(named, node.defaults, strict=True)
                       if a.arg == "grace"]
    assert values, f"no grace in {path}"
    return max(values)


@pytest.mark.parametrize("name", SERVICES)
def test_termination_grace_covers_prestop_and_the_drain(name):
    res = rendered("bundled")
    w = workload(res, name)
    c = main_container(w)
    pre = c.get("lifecycle", {}).get("preStop")
    wait = int(pre["exec"]["command"][1]) if pre else 0
    if pre:
        assert pre["exec"]["command"][0] == "sleep"
    # Behind a ClusterIP Service the pod must leave the endpoints before it stops taking
    # calls; engines are found through the directory by pod address instead.
    svc = services(res)[name]
    assert (wait >= 2 * c["readinessProbe"]["periodSeconds"]) == \
        (svc["spec"].get("clusterIP") != "None"), (name, wait)
    budget = w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert budget >= wait + drain_grace_s(DRAIN_CODE[name]) + 5, (name, budget)


@pytest.mark.parametrize("name", SERVICES)
def test_liveness_ignores_health_the_service_turns_off_at_run_time(name):
    """A service that reports NOT_SERVING while a dependency is down (the directory
    without Redis) must not be restarted for it: its liveness is a TCP check."""
    toggles = any("set_serving(" in p.read_text()
                  for p in (ROOT / "services" / name).glob("*.py"))
    live = main_container(workload(rendered("bundled"), name))["livenessProbe"]
    assert ("tcpSocket" in live) == toggles and ("grpc" in live) != toggles, live
    if "grpc" in live and name != "gateway":       # mutual TLS: probes use the health port
        assert live["grpc"]["port"] == 8086


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_leave_room_to_drain(overlay):
    res = rendered(overlay)
    pdbs = [r for r in res if r["kind"] == "PodDisruptionBudget"]
    assert {p["metadata"]["name"] for p in pdbs} == set(SERVICES)
    for p in pdbs:
        [w] = selected(res, p["spec"]["selector"]["matchLabels"])
        replicas = w["spec"]["replicas"]
        allowed = (replicas - p["spec"]["minAvailable"] if "minAvailable" in p["spec"]
                   else p["spec"]["maxUnavailable"])
        assert 1 <= allowed < replicas or replicas == allowed == 1, p
    assert workload(res, "kvstore")["spec"]["replicas"] == 1  # one owner of the index


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_containers_have_requests_within_limits_and_run_as_the_image_user(overlay):
    uid = int(re.search(r"useradd .*--uid (\d+)", (ROOT / "Dockerfile").read_text())[1])
    for w in (r for r in rendered(overlay) if r["kind"] in ("Deployment", "StatefulSet")):
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == uid
        if w["kind"] == "StatefulSet":  # its volume must be writable by that user
            assert pod["securityContext"]["fsGroup"] == uid
        for c in pod["containers"]:
            assert c["image"] == "kvmesh:local", c["image"]
            r = c["resources"]
            assert quantity(r["requests"]["cpu"]) <= quantity(r["limits"]["cpu"])
            assert memory_bytes(r["requests"]["memory"]) <= memory_bytes(r["limits"]["memory"])
            threads = {e["name"]: e.get("value") for e in c.get("env", [])}.get("OMP_NUM_THREADS")
            if threads:
                assert int(threads) == quantity(r["requests"]["cpu"])


def test_deepseek_v4_overlay_serves_the_mounted_checkpoint():
    res = rendered("deepseek-v4")
    assert parse(res, "engine").model == "/model"
    assert parse(res, "gateway").tokenizer == "/model/tokenizer.json"
    for name in ("engine", "gateway"):
        w = workload(res, name)
        tls, vol = w["spec"]["template"]["spec"]["volumes"]       # the base's, then the model
        assert tls["secret"]["secretName"] == "kvmesh-tls"
        assert vol["persistentVolumeClaim"] == {"claimName": "deepseek-v4-model", "readOnly": True}
        assert main_container(w)["volumeMounts"][1:] == [{"name": "model", "mountPath": "/model",
                                                          "readOnly": True}]
    bundled = rendered("bundled")                                  # the shipped model
    check_serves_the_shipped_model(parse(bundled, "engine"))
    assert parse(bundled, "gateway").tokenizer == parse(bundled, "engine").model + "/tokenizer.json"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_service_exposes_the_openai_http_api(overlay, monkeypatch):
    from kvmesh.services.gateway.cli import config_from_args as gateway_config

    res = rendered(overlay)
    c = main_container(workload(res, "gateway"))
    use_env(monkeypatch, container_env(res, c))
    port = gateway_config(parse(res, "gateway")).http_port
    assert port == named_port(c, "http") == 8000
    (svc,) = [r for r in res if r["kind"] == "Service" and r["metadata"]["name"] == "gateway"]
    assert {"name": "http", "port": port, "targetPort": "http", "appProtocol": "http"} in \
        svc["spec"]["ports"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_kvmesh_container_reads_the_service_token_and_only_kvstores_the_admin(overlay):
    import subprocess
    import sys

    res = rendered(overlay)
    for name in SERVICES:
        refs = {e["secretRef"]["name"] for e in main_container(workload(res, name))["envFrom"]
                if "secretRef" in e}
        want = {"kvmesh-service-token"} | ({"kvmesh-admin-token"} if name == "kvstore" else set())
        assert refs == want, (name, refs)
    for token in ("service", "admin"):     # the documented command makes the Secret's one key
        out = subprocess.run([sys.executable, str(ROOT / "scripts/backing_secrets.py"),
                              "--k8s-token", token], capture_output=True, text=True,
                             check=True).stdout
        key, value = out.strip().split("=", 1)
        assert key == f"KVMESH_{token.upper()}_TOKEN" and len(value) >= 32


def test_the_tls_secret_gives_mutual_tls_between_pods_dialled_by_ip(tmp_path, monkeypatch):
    """The documented kvmesh-tls Secret, mounted where the manifests mount it and read
    through the rendered KVMESH_TLS_* settings: a server dialled at an IP (as pods are) is
    verified against the name "kvmesh", a client needs the CA's certificate, and the
    kubelet's probe gets health in plaintext on the health port."""
    import asyncio
    import subprocess
    import sys

    from kvmesh.healthcheck import check
    from kvmesh.launch.backing.proc import free_port
    from kvmesh.rpc import Server
    from kvmesh.tls import TlsFiles

    secret = tmp_path / "tls-k8s"
    subprocess.run([sys.executable, str(ROOT / "scripts/backing_secrets.py"), "--k8s-tls",
                    str(secret)], check=True)
    assert (secret / "mesh.key").stat().st_mode & 0o777 == 0o600
    res = rendered("bundled")
    c = main_container(workload(res, "engine"))
    [mount] = [m for m in c["volumeMounts"] if m["name"] == "tls"]
    env = container_env(res, c)
    files = {}                                   # the Secret's keys at the mount's paths
    for var in ("KVMESH_TLS_CERT", "KVMESH_TLS_KEY", "KVMESH_TLS_CA"):
        path = Path(env[var])
        assert path.parent == Path(mount["mountPath"]), (var, path)
        files[var] = str(secret / path.name)
    as_pods = TlsFiles(cert=files["KVMESH_TLS_CERT"], key=files["KVMESH_TLS_KEY"],
                       ca=files["KVMESH_TLS_CA"], server_name=env["KVMESH_TLS_SERVER_NAME"])
    health_port = free_port()        # the manifests' 8086, moved off a port this host may use
    monkeypatch.setenv("KVMESH_TLS_HEALTH_PORT", str(health_port))

    async def go():
        server = Server("0.0.0.0:0", ["kvmesh.engine.v1.EngineService"], tls=as_pods,
                        service_token="t" * 20)
        await server.start()
        try:
            ip = f"127.0.0.2:{server.port}"     # an address the certificate does not name
            ok = lambda tls: asyncio.to_thread(check, ip, 5, tls)  # noqa: E731
            assert await ok(as_pods)
            no_name = TlsFiles(cert=as_pods.cert, key=as_pods.key, ca=as_pods.ca)
            assert not await ok(no_name)             # the certificate does not name the IP
            assert not await ok(TlsFiles(ca=as_pods.ca, server_name="kvmesh"))  # no client cert
            assert await asyncio.to_thread(check, f"127.0.0.2:{health_port}", 5, TlsFiles())
        finally:
            await server.stop(0)

    asyncio.run(go())
