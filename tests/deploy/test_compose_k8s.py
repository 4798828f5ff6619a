"""The deployment, checked offline (no Docker engine, no cluster): docker-compose.yml against the compose
spec and the stack's own rules, deploy/Dockerfile's targets, the Kubernetes manifests in deploy/k8s with
kubernetes-validate (core kinds) and by structure (the Prometheus Operator's kinds), and the generated
PrometheusRule against its rule files and promtool."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from support import load_script, require_tool

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
SECRETS = ROOT / "deploy" / "secrets"
K8S = ROOT / "deploy" / "k8s"
RULES = ROOT / "deploy" / "prometheus" / "rules"

#: the job the alert rules select (up{job="nanwatch-collector"}), in compose and on Kubernetes alike
JOB = "nanwatch-collector"
#: the only ports a person needs, by service: host port -> may NANWATCH_PUBLISH move it off loopback? The
#: shards publish nginx's TLS ports (nginx lives in their network namespace), never the collector's 8000.
PUBLISHED = {"collector": {8443: True, 9443: True}, "collector-1": {8444: True, 9444: True},
             "grafana": {3000: True}, "prometheus": {9090: False}, "alertmanager": {9093: False},
             "nginx": {}, "nginx-1": {}, "trainer": {},
             # profile "replicas" (docs/replicas.md): PostgreSQL is reached on the compose network only
             "postgres": {}, "replica": {8445: True, 9445: True}, "replica-1": {8446: True, 9446: True},
             "nginx-replica": {}, "nginx-replica-1": {}}
#: nginx in front of each shard or replica: nginx service -> its collector
NGINX = {"nginx": "collector", "nginx-1": "collector-1", "nginx-replica": "replica", "nginx-replica-1": "replica-1"}
#: the services of the "replicas" profile, not started by a plain `docker compose up`
REPLICAS_PROFILE = {"postgres", "replica", "replica-1", "nginx-replica", "nginx-replica-1"}
NGINX_CONF = ROOT / "deploy" / "nginx" / "nginx.conf"
#: API groups whose kinds kubernetes-validate has no schema for (CRDs): checked by structure instead
CRD_GROUPS = {"monitoring.coreos.com", "cert-manager.io"}
#: files in deploy/k8s that are examples, not resources (kustomization.yaml leaves them out)
EXAMPLES = {"secret.example.yaml", "certificate.example.yaml"}
#: the newest Kubernetes version the installed kubernetes-validate has schemas for
K8S_VERSION = kubernetes_validate.utils.latest_version()


generate = load_script(K8S / "generate.py", "nanwatch_deploy_k8s_generate")


def _pinned(ref: str) -> bool:
    """An image reference with an explicit tag other than latest (a digest alone counts too)."""
    name, _, digest = ref.partition("@")
    last = name.rsplit("/", 1)[-1]
    tag = last.partition(":")[2]
    return bool(digest) or (bool(tag) and tag != "latest")


# ---- docker-compose.yml -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _volumes(service: dict) -> list[dict]:
    """A service's volumes in the long syntax: type, source, target, read_only."""
    out = []
    for v in service.get("volumes", []):
        if isinstance(v, dict):
            out.append({"type": v["type"], "source": v.get("source"), "target": v["target"],
                        "read_only": bool(v.get("read_only"))})
            continue
        parts = v.split(":")
        source, target = (parts[0], parts[1]) if len(parts) > 1 else (None, parts[0])
        options = parts[2].split(",") if len(parts) > 2 else []
        kind = "bind" if source and source.startswith((".", "/", "~")) else "volume"
        out.append({"type": kind, "source": source, "target": target, "read_only": "ro" in options})
    return out


def _interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR:-default}`` and ``${VAR}`` with ``env`` (what an unset variable gives otherwise)."""
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: env.get(m.group(1)) or (m.group(2) or ""), text)


def _ports(service: dict, env: dict[str, str] | None = None) -> dict[int, str | None]:
    """A service's published ports: host port -> host address (None: every address), with ``env`` set."""
    out = {}
    for p in service.get("ports", []):
        if isinstance(p, dict):
            out[int(p["published"])] = p.get("host_ip")
            continue
        parts = _interpolate(str(p), env or {}).split(":")
        assert len(parts) in (2, 3), f"publish a port as [ip:]host:container, not {p!r}"
        out[int(parts[-2])] = parts[0] if len(parts) == 3 else None
    return out


def test_compose_file_validates_against_the_compose_spec():
    r = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                        str(COMPOSE)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_compose_has_the_stack(compose):
    assert set(compose["services"]) == set(PUBLISHED)


def test_every_service_has_a_healthcheck(compose):
    for name, svc in compose["services"].items():
        hc = svc.get("healthcheck")
        assert hc and not hc.get("disable") and hc.get("test"), f"{name}: no healthcheck"
        assert hc["test"][0] in ("CMD", "CMD-SHELL") and hc["test"] != ["NONE"], f"{name}: {hc['test']}"


def test_depends_on_waits_for_healthy_services(compose):
    services = compose["services"]
    for name, svc in services.items():
        deps = svc.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on as a list only waits for the start"
        for dep, how in deps.items():
            assert dep in services, f"{name} depends on an unknown service {dep}"
            assert how.get("condition") == "service_healthy", f"{name} -> {dep}: {how}"
    # the order that matters: nothing reports or scrapes before the collector is ready
    assert "collector" in services["trainer"]["depends_on"]
    assert "collector" in services["prometheus"]["depends_on"]
    assert "prometheus" in services["grafana"]["depends_on"]


def test_every_image_is_pinned(compose):
    for name, svc in compose["services"].items():
        assert "image" in svc, f"{name}: no image (a built service names its tag too)"
        assert _pinned(svc["image"]), f"{name}: image {svc['image']!r} is not pinned to a tag"


def test_every_bind_mount_is_read_only_and_exists(compose):
    binds = 0
    for name, svc in compose["services"].items():
        for v in _volumes(svc):
            if v["type"] != "bind":
                continue
            binds += 1
            assert v["read_only"], f"{name}: the bind mount {v['source']} -> {v['target']} is writable"
            # a missing source would be created as an empty folder: the service would start unconfigured
            assert (ROOT / v["source"]).exists(), f"{name}: bind-mount source {v['source']} does not exist"
    assert binds >= 4  # prometheus, alertmanager, grafana x2


def test_named_volumes_are_declared_and_hold_the_state(compose):
    declared = set(compose.get("volumes") or {})
    used = {}
    for name, svc in compose["services"].items():
        for v in _volumes(svc):
            if v["type"] == "volume":
                assert v["source"], f"{name}: anonymous volume at {v['target']}"
                assert v["source"] in declared, f"{name}: volume {v['source']} is not declared"
                used[(name, v["target"])] = v["source"]
    assert declared == set(used.values()), "a declared volume no service uses"
    for state in (("collector", "/data"), ("collector-1", "/data"), ("prometheus", "/prometheus"),
                  ("grafana", "/var/lib/grafana")):
        assert state in used, f"{state[0]}'s {state[1]} is not on a named volume"
    assert used[("collector", "/data")] != used[("collector-1", "/data")], "two shards on one SQLite file"


def test_ports_are_published_only_where_a_person_needs_them(compose):
    """Everything binds to loopback by default; NANWATCH_PUBLISH opens nginx and Grafana (both check who
    calls), never Prometheus or Alertmanager (no authentication of their own)."""
    for name, svc in compose["services"].items():
        ports = _ports(svc)
        assert set(ports) == set(PUBLISHED[name]), f"{name} publishes {sorted(ports)}"
        assert all(host == "127.0.0.1" for host in ports.values()), f"{name}: {ports} by default"
        opened = _ports(svc, {"NANWATCH_PUBLISH": "0.0.0.0"})
        for port, movable in PUBLISHED[name].items():
            assert opened[port] == ("0.0.0.0" if movable else "127.0.0.1"), f"{name}:{port} with NANWATCH_PUBLISH"
    assert "NANWATCH_PUBLISH" in COMPOSE.read_text().split("name: nanwatch")[0], "document NANWATCH_PUBLISH"


def test_no_container_port_8000_is_published(compose):
    """The collector's own port is reached only on the compose network; from outside only through nginx."""
    for name, svc in compose["services"].items():
        for p in svc.get("ports", []):
            container = p["target"] if isinstance(p, dict) else int(str(p).rsplit(":", 1)[1])
            assert int(container) in (8443, 9443, 3000, 9090, 9093), f"{name} publishes container port {container}"


def test_every_service_has_a_memory_limit(compose):
    for name, svc in compose["services"].items():
        limit = svc.get("mem_limit") or svc.get("deploy", {}).get("resources", {}).get("limits", {}).get("memory")
        assert limit, f"{name}: no memory limit"
    assert compose["services"]["collector"]["mem_limit"] == "1g"  # the k8s pod's limit (statefulset.yaml)


def test_nginx_fronts_each_shard_with_the_shipped_config(compose):
    """One nginx per shard, in the shard's network namespace (its upstream is 127.0.0.1:8000, as in the k8s
    pod), with deploy/nginx/nginx.conf and the TLS pair where the config reads them."""
    services = compose["services"]
    shards = sorted(n for n in services if n == "collector" or n.startswith(("collector-", "replica")))
    assert sorted(NGINX.values()) == shards
    conf = NGINX_CONF.read_text()
    assert "server 127.0.0.1:8000;" in conf
    for name, shard in NGINX.items():
        svc = services[name]
        assert svc["network_mode"] == f"service:{shard}"
        assert svc["depends_on"] == {shard: {"condition": "service_healthy"}}
        [mount] = [v for v in _volumes(svc) if v["type"] == "bind"]
        assert (ROOT / mount["source"]).resolve() == NGINX_CONF and mount["read_only"]
        command = svc["entrypoint"]
        assert command[0] == "nginx" and command[command.index("-c") + 1] == mount["target"]
        targets = {s["target"] for s in svc["secrets"]}
        for path in re.findall(r"ssl_certificate(?:_key)?\s+(\S+);", conf):
            assert path in targets, f"{name}: nginx.conf reads {path}, which compose does not mount"
        assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"] and "/tmp" in svc["tmpfs"]
        published = {int(str(p).rsplit(":", 1)[1]) for p in services[shard]["ports"]}
        assert published == {int(p) for p in re.findall(r"listen (\d+) ssl;", conf)}


def test_secrets_come_from_gitignored_files_that_are_documented(compose):
    secrets = compose["secrets"]
    readme = (SECRETS / "README.md").read_text()
    for name, spec in secrets.items():
        path = (ROOT / spec["file"]).resolve()
        assert path.parent == SECRETS, f"secret {name}: keep its file in deploy/secrets/"
        assert f"`{path.name}`" in readme, f"deploy/secrets/README.md does not say how to create {path.name}"
        if shutil.which("git") and (ROOT / ".git").exists():
            ignored = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=ROOT).returncode
            assert ignored == 0, f"{spec['file']} is not gitignored"
    if shutil.which("git") and (ROOT / ".git").exists():
        assert subprocess.run(["git", "check-ignore", "-q", str(SECRETS / "README.md")], cwd=ROOT).returncode == 1
    for name, svc in compose["services"].items():
        for s in svc.get("secrets", []):
            assert (s if isinstance(s, str) else s["source"]) in secrets, f"{name}: undeclared secret {s}"
        env = svc.get("environment") or {}
        for key in env if isinstance(env, dict) else [e.split("=", 1)[0] for e in env]:
            assert not re.search(r"TOKEN$|PASSWORD$", key), f"{name}: {key} in the environment; use a file"


def test_collector_and_trainer_read_their_tokens_from_their_secrets(compose):
    collector, trainer = compose["services"]["collector"], compose["services"]["trainer"]
    env = collector["environment"]
    for var in ("NANWATCH_TOKEN_FILE", "NANWATCH_ADMIN_TOKEN_FILE"):
        secret = env[var].removeprefix("/run/secrets/")
        assert secret in collector["secrets"], f"{var} points at {env[var]}, not a secret the collector mounts"
    ingest = env["NANWATCH_TOKEN_FILE"].removeprefix("/run/secrets/")
    assert trainer["secrets"] == [ingest]
    assert trainer["environment"]["NANWATCH_TOKEN_FILE"] == f"/run/secrets/{ingest}"  # the trainer reads it too
    command = " ".join(trainer["command"])
    assert "--collector http://collector:8000" in command and "--run-id compose-demo" in command


def test_built_services_use_the_dockerfile_targets(compose):
    stages = {s["name"] for s in _stages()}
    for name in ("collector", "trainer"):
        build = compose["services"][name]["build"]
        assert build["context"] == "."
        assert (ROOT / build["dockerfile"]).resolve() == DOCKERFILE
        assert build["target"] in stages


def test_prometheus_config_matches_the_stack(compose):
    """prometheus.yml (mounted by compose) scrapes the collector as the job the alerts select, and sends
    alerts to the compose Alertmanager."""
    services = compose["services"]
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    targets = [t for sc in jobs[JOB]["static_configs"] for t in sc["targets"]]
    shards = sorted(name for name in services if name == "collector" or name.startswith("collector-"))
    assert targets == [f"{name}:8000" for name in shards] == ["collector:8000", "collector-1:8000"]
    for name in shards:  # every shard is the same collector, behind the same tokens
        assert services[name]["environment"] == services["collector"]["environment"]
        assert services[name]["image"] == services["collector"]["image"]
        assert name in services["prometheus"]["depends_on"]
    am = [t for a in config["alerting"]["alertmanagers"] for sc in a["static_configs"] for t in sc["targets"]]
    assert am == ["alertmanager:9093"]
    # meta-monitoring: Prometheus scrapes itself and the Alertmanager it pages through
    assert [t for sc in jobs["prometheus"]["static_configs"] for t in sc["targets"]] == ["localhost:9090"]
    assert [t for sc in jobs["alertmanager"]["static_configs"] for t in sc["targets"]] == am
    assert {"collector", "alertmanager"} <= set(services)


def test_replicas_profile_shares_one_postgres(compose):
    """Profile "replicas": two collector replicas of the collector's image and tokens on one PostgreSQL,
    its URL (which carries the password) from a secret file, no SQLite volume, one name on the compose
    network for both; nothing in the default stack waits for them."""
    services = compose["services"]
    assert {n for n, svc in services.items() if svc.get("profiles")} == REPLICAS_PROFILE
    assert all(services[n]["profiles"] == ["replicas"] for n in REPLICAS_PROFILE)
    for name in set(services) - REPLICAS_PROFILE:
        assert not set(services[name].get("depends_on", {})) & REPLICAS_PROFILE, name
    pg = services["postgres"]
    assert pg["environment"]["POSTGRES_PASSWORD_FILE"] == "/run/secrets/nanwatch_postgres_password"
    assert pg["secrets"] == ["nanwatch_postgres_password"]
    assert [v["target"] for v in _volumes(pg)] == ["/var/lib/postgresql/data"]
    for name in ("replica", "replica-1"):
        svc = services[name]
        assert svc["image"] == services["collector"]["image"] and svc["build"] == services["collector"]["build"]
        # the collector image's command without its --db (nanwatch serve refuses a file beside a URL)
        image_cmd = json.loads(re.findall(r"^CMD (\[.*\])$", DOCKERFILE.read_text(), re.M)[-1])
        assert "--db" not in svc["command"] and svc["command"] == image_cmd[:image_cmd.index("--db")]
        env = svc["environment"]
        assert {k: v for k, v in env.items() if k != "NANWATCH_DATABASE_URL_FILE"} == services["collector"]["environment"]
        assert env["NANWATCH_DATABASE_URL_FILE"].removeprefix("/run/secrets/") in svc["secrets"]
        assert svc["volumes"] == [] and svc["depends_on"] == {"postgres": {"condition": "service_healthy"}}
        assert svc["networks"]["default"]["aliases"] == ["collector-replicas"]
    # Prometheus scrapes each replica, found by that name (under the default profile it resolves to no
    # target: none shows down), as the job the alerts select
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == JOB]
    assert job["dns_sd_configs"] == [{"names": ["collector-replicas"], "type": "A", "port": 8000,
                                      "refresh_interval": "30s"}]
    readme = (SECRETS / "README.md").read_text()
    assert "postgresql://nanwatch:" in readme and "@postgres:5432/nanwatch" in readme


def test_grafana_provisioning_matches_the_stack(compose):
    """Datasources point at compose services; the dashboard provider reads the folder compose mounts."""
    services = compose["services"]
    mounts = {v["source"].removeprefix("./"): v["target"] for v in _volumes(services["grafana"])
              if v["type"] == "bind"}
    assert mounts["grafana/provisioning"] == "/etc/grafana/provisioning"
    files = sorted((ROOT / "grafana" / "provisioning").glob("*/*.y*ml"))
    assert files, "grafana/provisioning holds no provisioning file"
    providers = datasources = 0
    for f in files:
        doc = yaml.safe_load(f.read_text()) or {}
        for ds in doc.get("datasources", []):
            datasources += 1
            host = urlsplit(ds["url"]).hostname
            assert host in services, f"{f.name}: datasource {ds['name']} points at {ds['url']}"
        for p in doc.get("providers", []):
            providers += 1
            assert p["options"]["path"].rstrip("/") == mounts["grafana/dashboards"], f"{f.name}: {p}"
    assert datasources and providers


# ---- deploy/Dockerfile ------------------------------------------------------------------------------------

def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; continuation lines joined, comments dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        instr, _, args = (buf + s).partition(" ")
        out.append((instr.upper(), args.strip()))
        buf = ""
    assert not buf, "the Dockerfile ends in a continuation line"
    return out


def _stages() -> list[dict]:
    stages: list[dict] = []
    for instr, args in _instructions(DOCKERFILE.read_text()):
        if instr == "FROM":
            words = [w for w in args.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].lower() == "as" else None
            stages.append({"name": name, "base": words[0], "instructions": []})
        else:
            assert stages, f"{instr} before the first FROM"
            stages[-1]["instructions"].append((instr, args))
    return stages


def _chain(target: str) -> list[dict]:
    """The stages an image is built from, its own last (FROM <stage> inherits that stage's settings)."""
    by_name = {s["name"]: s for s in _stages()}
    chain = [by_name[target]]
    while chain[0]["base"] in by_name:
        chain.insert(0, by_name[chain[0]["base"]])
    return chain


def _stage(name: str) -> list[tuple[str, str]]:
    return next(s["instructions"] for s in _stages() if s["name"] == name)


def _last(target: str, instr: str) -> str | None:
    found = [a for s in _chain(target) for i, a in s["instructions"] if i == instr]
    return found[-1] if found else None


def _build_runs(target: str) -> str:
    """Every RUN of the stages whose /opt/venv the target copies, and of its own chain."""
    stages = {s["name"]: s for s in _stages()}
    runs = []
    for stage in _chain(target):
        for instr, args in stage["instructions"]:
            if instr == "COPY" and "--from=" in args:
                source = re.search(r"--from=(\S+)", args).group(1)
                runs += [a for s in _chain(stages[source]["name"]) for i, a in s["instructions"] if i == "RUN"]
            elif instr == "RUN":
                runs.append(args)
    return "\n".join(runs)


def test_dockerfile_base_images_are_pinned():
    stages = _stages()
    names = {s["name"] for s in stages}
    external = [s["base"] for s in stages if s["base"] not in names]
    assert external
    for ref in external:
        assert _pinned(ref), f"FROM {ref}: pin a tag"
        assert ref.startswith("python:3.12-slim"), ref


@pytest.mark.parametrize("target", ["collector", "trainer"])
def test_images_run_as_a_non_root_user(target):
    user = _last(target, "USER")
    assert user, f"{target}: no USER, so it runs as root"
    uid = user.split(":")[0]
    assert uid not in ("root", "0")
    # numeric: Kubernetes' runAsNonRoot can only check a numeric user; deploy/k8s runs as the same uid
    assert uid.isdigit(), f"{target}: USER {user} is not numeric"


def test_collector_image():
    assert _stages()[-1]["name"] == "collector", "a plain `docker build` (no --target) must give the collector"
    healthcheck = _last("collector", "HEALTHCHECK")
    assert healthcheck and "urllib" in healthcheck and "http://127.0.0.1:8000/healthz" in healthcheck
    assert _last("collector", "EXPOSE") == "8000"
    assert json.loads(_last("collector", "ENTRYPOINT")) == ["nanwatch"]
    assert json.loads(_last("collector", "CMD")) == ["serve", "--host", "0.0.0.0", "--port", "8000",
                                                    "--db", "/data/nanwatch.db"]
    assert _last("collector", "VOLUME") == "/data"
    runs = _build_runs("collector")
    assert 'pip install --no-cache-dir ".[monitor,postgres]"' in runs  # one image: SQLite or a replica
    assert "torch" not in runs and "[demo]" not in runs
    # /data belongs to the image's user (set before VOLUME, or it would not stick)
    uid = _last("collector", "USER").split(":")[0]
    assert any(i == "RUN" and f"chown {uid}" in a and "/data" in a for s in _chain("collector")
               for i, a in s["instructions"])


def test_trainer_image():
    runs = _build_runs("trainer")
    torch_at = runs.index("--index-url https://download.pytorch.org/whl/cpu torch==2.13.0")
    assert torch_at < runs.index('".[demo]"'), "torch (CPU) must be installed before .[demo] pulls one"
    assert json.loads(_last("trainer", "ENTRYPOINT")) == ["nanwatch"]
    cmd = json.loads(_last("trainer", "CMD"))
    assert cmd[0] == "demo" and cmd[cmd.index("--collector") + 1] == "http://collector:8000"


def test_dockerfile_copies_every_package_folder():
    """pip builds from the COPYed files alone: every folder of pyproject's package-dir must be there."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = {d.split("/")[0] for d in pyproject["tool"]["setuptools"]["package-dir"].values()}
    copied = set()
    for instr, args in _stage("src"):
        if instr == "COPY" and "--from=" not in args:
            copied |= {w.rstrip("/") for w in args.split()[:-1]}
    assert folders | {"pyproject.toml", "README.md"} <= copied
    for path in copied:
        assert (ROOT / path).exists(), f"COPY {path}: no such file in the build context"


# ---- deploy/k8s -------------------------------------------------------------------------------------------

def _manifests() -> dict[str, dict]:
    """Every Kubernetes object in deploy/k8s, by file name (one object per file)."""
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        assert len(docs) == 1, f"{path.name}: one object per file"
        out[path.name] = docs[0]
    return out


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict]:
    return _manifests()


def _of_kind(manifests: dict[str, dict], kind: str) -> dict:
    found = [m for m in manifests.values() if m["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects in deploy/k8s"
    return found[0]


def _core(manifests: dict[str, dict]) -> dict[str, dict]:
    return {f: m for f, m in manifests.items() if m["apiVersion"].split("/")[0] not in CRD_GROUPS}


def test_every_manifest_kind_is_expected(manifests):
    kinds = sorted(m["kind"] for m in manifests.values())
    assert kinds == ["Certificate", "ConfigMap", "NetworkPolicy", "PrometheusRule", "Secret", "Service",
                     "ServiceMonitor", "StatefulSet"]


@pytest.mark.parametrize("name", sorted(_core(_manifests())))
def test_core_manifest_validates(name, manifests):
    kubernetes_validate.validate(manifests[name], K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest_but_the_examples(manifests):
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources))
    assert set(resources) == set(manifests) - EXAMPLES


def test_kustomize_builds_and_the_result_validates():
    """`kubectl kustomize` where kubectl is installed (it needs no cluster); CI has none, so a plain skip."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    r = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "NetworkPolicy", "PrometheusRule", "Service",
                                               "ServiceMonitor", "StatefulSet"]
    for d in docs:
        if d["apiVersion"].split("/")[0] not in CRD_GROUPS:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)


def test_statefulset_of_shards(manifests):
    """Collector shards: one pod per identity (never two writers on one SQLite file), each with its own
    volume from a claim template, named through the headless Service."""
    dep = _of_kind(manifests, "StatefulSet")
    spec, pod = dep["spec"], dep["spec"]["template"]["spec"]
    assert sorted(x["name"] for x in pod["containers"]) == ["collector", "nginx"]
    assert spec["replicas"] >= 2 and spec["serviceName"] == _of_kind(manifests, "Service")["metadata"]["name"]
    assert spec["updateStrategy"]["type"] == "RollingUpdate" and spec["podManagementPolicy"] == "Parallel"
    assert spec["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    c = _container(dep, "collector")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe, path in (("startupProbe", "/readyz"), ("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = c[probe]["httpGet"]
        assert get["path"] == path
        assert ports.get(get["port"], get["port"]) == 8000

    pod_sc, sc = pod.get("securityContext", {}), c["securityContext"]
    assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True
    assert str(sc.get("runAsUser", pod_sc.get("runAsUser"))) == _last("collector", "USER").split(":")[0]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(c["resources"][kind]), f"resources.{kind}"

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert "emptyDir" in volumes[mounts["/tmp"]], "a read-only root needs a writable /tmp"
    [claim] = spec["volumeClaimTemplates"]  # /data: the shard's own volume, not a volume of the pod spec
    assert mounts["/data"] == claim["metadata"]["name"] and mounts["/data"] not in volumes
    # one pod per volume, enforced by the cluster (and the collector's own <db>.lock)
    assert claim["spec"]["accessModes"] == ["ReadWriteOncePod"] and claim["spec"]["resources"]["requests"]["storage"]
    assert c["args"][c["args"].index("--db") + 1].startswith("/data/")

    # the tokens: files from a Secret, named by *_TOKEN_FILE; never a value in the environment
    env = {e["name"]: e for e in c["env"]}
    assert not {"NANWATCH_TOKEN", "NANWATCH_ADMIN_TOKEN"} & set(env)
    example = _of_kind(manifests, "Secret")
    for var in ("NANWATCH_TOKEN_FILE", "NANWATCH_ADMIN_TOKEN_FILE"):
        file = Path(env[var]["value"])
        volume = volumes[mounts[str(file.parent)]]
        secret = volume["secret"]
        assert secret["secretName"] == example["metadata"]["name"]
        keys = {i["path"]: i["key"] for i in secret.get("items", [])} or {k: k for k in example["stringData"]}
        assert keys[file.name] in example["stringData"], f"{var}: no key for {file.name} in the Secret"


def _container(statefulset: dict, name: str) -> dict:
    [c] = [x for x in statefulset["spec"]["template"]["spec"]["containers"] if x["name"] == name]
    return c


def _nginx_ports() -> dict[str, int]:
    """nginx.conf's TLS ports by what they are for: https (trainers, readers), https-admin."""
    conf = NGINX_CONF.read_text()
    ports = [int(p) for p in re.findall(r"listen (\d+) ssl;", conf)]
    assert ports == [8443, 9443], ports
    return {"https": 8443, "https-admin": 9443}


def test_nginx_sidecar_serves_the_shipped_config_with_the_tls_secret(manifests):
    """Each pod's nginx: the generated ConfigMap where its command reads it, the kubernetes.io/tls Secret
    where nginx.conf reads the pair, nginx.conf's ports, and the collector's own hardening."""
    dep = _of_kind(manifests, "StatefulSet")
    pod, c = dep["spec"]["template"]["spec"], _container(dep, "nginx")
    assert _pinned(c["image"]) and "nginx" in c["image"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == _nginx_ports()
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    conf = c["command"][c["command"].index("-c") + 1]
    assert c["command"][0] == "nginx" and "daemon off;" in c["command"]
    configmap = volumes[mounts[str(Path(conf).parent)]["name"]]["configMap"]
    assert configmap["name"] == _of_kind(manifests, "ConfigMap")["metadata"]["name"] == generate.NGINX_CONFIGMAP
    assert Path(conf).name in _of_kind(manifests, "ConfigMap")["data"]
    text = NGINX_CONF.read_text()
    for path in re.findall(r"ssl_certificate(?:_key)?\s+(\S+);", text):
        secret = volumes[mounts[str(Path(path).parent)]["name"]]["secret"]
        assert Path(path).name in {i["path"] for i in secret["items"]}
        assert secret["secretName"] == _of_kind(manifests, "Certificate")["spec"]["secretName"]
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]], "nginx writes its pid and spooled bodies to /tmp"
    assert all(m.get("readOnly") for path, m in mounts.items() if path != "/tmp")
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and sc["runAsNonRoot"] is True
    assert {"cpu", "memory"} <= set(c["resources"]["limits"])
    # the upstream is the collector in the same pod
    collector = _container(dep, "collector")
    assert "server 127.0.0.1:8000;" in text and 8000 in {p["containerPort"] for p in collector["ports"]}


def test_service_and_servicemonitor(manifests):
    svc, sm = _of_kind(manifests, "Service"), _of_kind(manifests, "ServiceMonitor")
    dep = _of_kind(manifests, "StatefulSet")
    labels = svc["metadata"]["labels"]
    # headless: each shard its own DNS name and its own scrape target, no virtual IP spreading a run over shards
    assert svc["spec"]["clusterIP"] == "None"
    assert labels["app.kubernetes.io/name"] == "nanwatch-collector"
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    # nginx's TLS ports only: the collector's own 8000 is not in the Service
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert {name: p["port"] for name, p in ports.items()} == _nginx_ports()
    nginx = {p["name"] for p in _container(dep, "nginx")["ports"]}
    assert all(p["targetPort"] in nginx for p in ports.values())

    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["kind"] == "ServiceMonitor"
    assert sm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    [endpoint] = sm["spec"]["endpoints"]
    # scraped through nginx with TLS, checked against the CA in the TLS Secret and the Service's name
    assert endpoint["port"] == "https" and endpoint["scheme"] == "https"
    tls = endpoint["tlsConfig"]
    cert = _of_kind(manifests, "Certificate")["spec"]
    assert tls["ca"]["secret"] == {"name": cert["secretName"], "key": "ca.crt"}
    assert tls["serverName"] in cert["dnsNames"] and not tls.get("insecureSkipVerify")
    assert endpoint["path"] == "/metrics" and endpoint["interval"] == "15s"
    assert {"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "instance"} in endpoint["relabelings"]
    # The operator's job label: the value of the Service label named by jobLabel, else the Service's name.
    job = labels[sm["spec"]["jobLabel"]] if "jobLabel" in sm["spec"] else svc["metadata"]["name"]
    assert job == JOB
    rules = yaml.safe_load((K8S / "prometheusrule.yaml").read_text())["spec"]["groups"]
    exprs = " ".join(r["expr"] for g in rules for r in g["rules"])
    selected = set(re.findall(r'job\s*=~?\s*"([^"]*)"', exprs))
    assert selected == {JOB}, f"the rules select job {selected}"
    # kube-prometheus-stack loads ServiceMonitors and PrometheusRules by its release label: both carry it
    rule_labels = yaml.safe_load((K8S / "prometheusrule.yaml").read_text())["metadata"]["labels"]
    assert sm["metadata"]["labels"]["release"] == rule_labels["release"] == generate.RELEASE


def test_networkpolicy_admits_each_role_on_its_port_only(manifests):
    """Trainers and Prometheus reach nginx's https port, operators also https-admin; nobody the collector's
    own port; the pods open no connection (egress denied)."""
    policy, dep = _of_kind(manifests, "NetworkPolicy"), _of_kind(manifests, "StatefulSet")
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert spec["policyTypes"] == ["Ingress", "Egress"] and spec["egress"] == []
    nginx = {p["name"] for p in _container(dep, "nginx")["ports"]}
    by_peer = {}
    for rule in spec["ingress"]:
        [peer] = rule["from"]
        assert peer.get("namespaceSelector", {}).get("matchLabels"), f"{rule}: no namespace selector"
        key = (tuple(sorted(peer["namespaceSelector"]["matchLabels"].items())),
               tuple(sorted(peer.get("podSelector", {}).get("matchLabels", {}).items())))
        ports = {p["port"] for p in rule["ports"]}
        assert ports <= nginx, f"{ports - nginx}: only nginx's ports may be reached"
        by_peer[key] = ports
    trainers = ((("nanwatch.dev/trainers", "true"),), ())
    prometheus = ((("kubernetes.io/metadata.name", "monitoring"),), (("app.kubernetes.io/name", "prometheus"),))
    operators = ((("nanwatch.dev/operators", "true"),), ())
    assert by_peer == {trainers: {"https"}, prometheus: {"https"}, operators: {"https", "https-admin"}}
    text = (K8S / "networkpolicy.yaml").read_text()
    for label in ("nanwatch.dev/trainers=true", "nanwatch.dev/operators=true"):
        assert "kubectl label namespace" in text and label in text, f"document {label}"


def test_certificate_example_names_every_shard(manifests):
    """cert-manager's Certificate (optional, not applied by kustomize) fills the Secret nginx mounts, for
    the names trainers dial (nanwatch-collector-<i>.nanwatch-collector...) and the Service's."""
    cert = _of_kind(manifests, "Certificate")
    assert cert["apiVersion"] == "cert-manager.io/v1"
    names = cert["spec"]["dnsNames"]
    service = _of_kind(manifests, "Service")["metadata"]["name"]
    assert service in names and f"*.{service}" in names and f"*.{service}.NAMESPACE.svc" in names
    assert "kubernetes.io/tls" in (K8S / "certificate.example.yaml").read_text()


def test_example_secret_holds_placeholders_only(manifests):
    secret = _of_kind(manifests, "Secret")
    assert "data" not in secret
    for key, value in secret["stringData"].items():
        assert value.startswith("REPLACE-ME"), f"{key}: an example must not carry a usable token"
    assert "create" in (K8S / "secret.example.yaml").read_text().split("apiVersion")[0].lower()


# ---- the generated PrometheusRule -------------------------------------------------------------------------

def test_prometheusrule_is_what_generate_writes():
    text = (K8S / "prometheusrule.yaml").read_text()
    assert text == generate.render(), "deploy/k8s/prometheusrule.yaml is stale: run python deploy/k8s/generate.py"
    assert text.startswith("# generated by deploy/k8s/generate.py from deploy/prometheus/rules; do not edit\n")
    r = subprocess.run([sys.executable, str(K8S / "generate.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_prometheusrule_holds_every_group_of_every_rule_file_in_file_order():
    rule = yaml.safe_load((K8S / "prometheusrule.yaml").read_text())
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    files = sorted(RULES.glob("*.yml"), key=lambda p: p.name)
    assert files
    expected = [g for f in files for g in yaml.safe_load(f.read_text())["groups"]]
    assert rule["spec"]["groups"] == expected
    assert rule == generate.prometheus_rule()


def test_nginx_configmap_is_what_generate_writes():
    text = (K8S / "nginx-configmap.yaml").read_text()
    assert text == generate.render_nginx(), "deploy/k8s/nginx-configmap.yaml is stale: run python deploy/k8s/generate.py"
    assert yaml.safe_load(text)["data"] == {"nginx.conf": NGINX_CONF.read_text()}


def test_generate_check_fails_on_drift(tmp_path, monkeypatch, capsys):
    stale, nginx = tmp_path / "prometheusrule.yaml", tmp_path / "nginx-configmap.yaml"
    monkeypatch.setattr(generate, "OUTPUT", stale)
    monkeypatch.setattr(generate, "NGINX_OUTPUT", nginx)
    assert generate.main(["--check"]) == 1  # missing
    stale.write_text(generate.render().replace("for: 0m", "for: 1m", 1))
    nginx.write_text(generate.render_nginx())
    assert generate.main(["--check"]) == 1  # edited by hand
    assert generate.main([]) == 0 and generate.main(["--check"]) == 0
    assert stale.read_text() == generate.render()
    nginx.write_text(generate.render_nginx().replace("keepalive_timeout 15s", "keepalive_timeout 75s"))
    assert generate.main(["--check"]) == 1  # the ConfigMap edited instead of nginx.conf


def test_generate_refuses_duplicate_group_names(tmp_path):
    group = {"groups": [{"name": "same", "rules": [{"record": "a:b:c", "expr": "1"}]}]}
    for name in ("a.yml", "b.yml"):
        (tmp_path / name).write_text(yaml.safe_dump(group))
    with pytest.raises(ValueError, match="same"):
        generate.prometheus_rule(tmp_path)


def test_prometheusrule_spec_passes_promtool(tmp_path):
    promtool = require_tool("promtool")
    spec = yaml.safe_load((K8S / "prometheusrule.yaml").read_text())["spec"]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# ---- deploy/k8s-replicas: collector replicas on PostgreSQL (docs/replicas.md), an overlay of deploy/k8s ---
#: beside deploy/k8s, not in it: kustomize refuses an overlay inside its base's folder
REPLICAS = ROOT / "deploy" / "k8s-replicas"


def _yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_replicas_deployment_is_the_statefulsets_pod_on_postgres(manifests):
    """Two replicas of the shards' pod (same collector, nginx, probes, limits, hardening), without the SQLite
    volume, with the database URL from a Secret file; it validates as a core object."""
    dep, sts = _yaml(REPLICAS / "deployment.yaml"), _of_kind(manifests, "StatefulSet")
    kubernetes_validate.validate(dep, K8S_VERSION, strict=True)
    assert dep["kind"] == "Deployment" and dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert dep["metadata"] == sts["metadata"] and dep["spec"]["selector"] == sts["spec"]["selector"]
    pod, spod = dep["spec"]["template"]["spec"], sts["spec"]["template"]["spec"]
    assert dep["spec"]["template"]["metadata"] == sts["spec"]["template"]["metadata"]
    assert _container(dep, "nginx") == _container(sts, "nginx")
    c, sc = _container(dep, "collector"), _container(sts, "collector")
    assert "--db" not in c["args"] and c["args"] == sc["args"][:sc["args"].index("--db")]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert {k: v for k, v in env.items() if k != "NANWATCH_DATABASE_URL_FILE"} == \
        {e["name"]: e["value"] for e in sc["env"]}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert "data" not in mounts and env["NANWATCH_DATABASE_URL_FILE"] == mounts["database"] + "/uri"
    same = {k: v for k, v in c.items() if k not in ("args", "env", "volumeMounts")}
    assert same == {k: v for k, v in sc.items() if k not in ("args", "env", "volumeMounts")}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert [i["key"] for i in volumes["database"]["secret"]["items"]] == ["uri"]
    assert {k: v for k, v in volumes.items() if k != "database"} == {v["name"]: v for v in spod["volumes"]}
    assert {k: v for k, v in pod.items() if k not in ("containers", "volumes")} == \
        {k: v for k, v in spod.items() if k not in ("containers", "volumes")}


def test_replicas_overlay_swaps_the_shards_for_the_deployment_and_reaches_its_database(manifests):
    k = _yaml(REPLICAS / "kustomization.yaml")
    assert k["kind"] == "Kustomization" and k["resources"] == ["../k8s", "deployment.yaml"]
    patches = [yaml.safe_load(p["patch"]) for p in k["patches"]]
    [delete] = [p for p in patches if p.get("$patch") == "delete"]
    sts = _of_kind(manifests, "StatefulSet")
    assert (delete["kind"], delete["metadata"]["name"]) == ("StatefulSet", sts["metadata"]["name"])
    [egress] = [p for p in patches if p["kind"] == "NetworkPolicy"]
    assert egress["metadata"]["name"] == _of_kind(manifests, "NetworkPolicy")["metadata"]["name"]
    cluster = _yaml(REPLICAS / "postgres.example.yaml")
    assert (cluster["apiVersion"], cluster["kind"]) == ("postgresql.cnpg.io/v1", "Cluster")
    name = cluster["metadata"]["name"]
    to_db = [r for r in egress["spec"]["egress"]
             if r["to"][0].get("podSelector", {}).get("matchLabels") == {"cnpg.io/cluster": name}]
    assert [p["port"] for r in to_db for p in r["ports"]] == [5432]
    assert any(p["port"] == 53 for r in egress["spec"]["egress"] for p in r["ports"])
    # the Secret CloudNativePG makes for the bootstrapped database is the one the Deployment mounts
    dep = _yaml(REPLICAS / "deployment.yaml")
    [db] = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "database"]
    assert db["secret"]["secretName"] == f"{name}-app"
    assert cluster["spec"]["bootstrap"]["initdb"] == {"database": "nanwatch", "owner": "nanwatch"}
    assert cluster["spec"]["instances"] >= 2 and cluster["spec"]["storage"]["size"]


def test_replicas_overlay_builds_where_kubectl_is_installed():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    r = subprocess.run([kubectl, "kustomize", str(REPLICAS)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "Deployment", "NetworkPolicy", "PrometheusRule",
                                               "Service", "ServiceMonitor"]
    [policy] = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert policy["spec"]["egress"] and policy["spec"]["ingress"]  # the patch added egress, kept ingress
    for d in docs:
        if d["apiVersion"].split("/")[0] not in CRD_GROUPS:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
