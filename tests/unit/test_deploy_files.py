"""Static checks of the deployment files (no Docker engine here): the compose file against the Compose
specification's JSON schema, and every image, file, port, env name and command consistent with the code."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from infra.services import DEFAULT_PORTS

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
SECRETISH = re.compile(r"PASSWORD|SECRET|TOKEN|AUTH_STRING|ACCESS_KEY", re.I)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def env_example() -> dict[str, str]:
    pairs = [
        line.split("=", 1)
        for line in (DOCKER / "env.example").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    ]
    return {k.strip(): v.strip() for k, v in pairs}


def test_compose_matches_the_compose_spec_schema(compose):
    # the Compose specification schema as shipped in docker/compose 1.29.2 (Apache-2.0), vendored for offline use
    schema = json.loads((ROOT / "tests/assets/compose_spec.json").read_text())
    errors = [f"{list(e.path)}: {e.message}" for e in jsonschema.Draft7Validator(schema).iter_errors(compose)]
    assert not errors, errors


def test_services_are_complete(compose):
    services = compose["services"]
    assert set(services) >= {
        "postgres",
        "minio",
        "mlflow",
        "prefect-server",
        "prefect-worker",
        "ray-head",
        "ray-worker",
    }
    for name in ("postgres", "minio", "mlflow", "prefect-server", "ray-head"):
        assert "healthcheck" in services[name], name
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, (name, dependency)
        build = service.get("build")
        if build:
            assert (DOCKER / build["context"] / build["dockerfile"]).is_file()
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DOCKER / source).exists(), (name, source)
            else:
                assert source in compose["volumes"], (name, source)
    assert services["prefect-worker"]["image"] == services["mlflow"]["image"] == "lmforge:cpu"


def test_published_ports_bind_loopback_and_match_the_code(compose):
    published = {}
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            host, outside, inside = port.split(":")
            assert host == "127.0.0.1", f"{name} publishes {port} on every interface"
            published[name] = int(inside)
    assert published["mlflow"] == DEFAULT_PORTS["mlflow"]
    assert published["prefect-server"] == DEFAULT_PORTS["prefect"]
    assert published["ray-head"] == DEFAULT_PORTS["ray_dashboard"]


def test_no_secret_values_in_the_files(compose):
    documented = env_example()
    text = (DOCKER / "compose.yaml").read_text()
    for variable in set(re.findall(r"\$\{(\w+)\}", text)):
        assert variable in documented, f"${{{variable}}} is not documented in docker/env.example"
    for key, value in documented.items():
        if SECRETISH.search(key):
            assert value == "", f"docker/env.example must not carry a value for {key}"

    def walk(node, path=""):
        if isinstance(node, dict):
            for k, v in node.items():
                if SECRETISH.search(str(k)) and isinstance(v, str):
                    assert v.startswith("${"), f"{path}.{k} holds a literal secret"
                walk(v, f"{path}.{k}")
        elif isinstance(node, list):
            for item in node:
                walk(item, path)

    walk(compose)
    assert "docker/.env" in (ROOT / ".gitignore").read_text()


def test_commands_agree_with_the_code(compose):
    prefect = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    pool = prefect["deployments"][0]["work_pool"]["name"]
    assert f"--pool {pool}" in compose["services"]["prefect-worker"]["command"]
    assert "--app-name basic-auth" in (DOCKER / "mlflow-entrypoint.sh").read_text()
    assert compose["services"]["ray-head"]["environment"]["RAY_AUTH_MODE"] == "token"
    makefile = (ROOT / "Makefile").read_text()
    torch_pin = re.search(r"torch==([\d.]+)", makefile).group(1)
    for dockerfile in ("Dockerfile.cpu", "Dockerfile.cuda"):
        text = (DOCKER / dockerfile).read_text()
        assert f"torch=={torch_pin}" in text, dockerfile
        for source in re.findall(r"^COPY (\S+) ", text, re.M):
            assert (ROOT / source).exists(), (dockerfile, source)


def test_ray_cluster_and_kuberay_manifests():
    import ray

    cluster = yaml.safe_load((ROOT / "infra/ray/cluster.yaml").read_text())
    assert cluster["head_node_type"] in cluster["available_node_types"]
    assert cluster["docker"]["image"].endswith("lmforge:cuda")
    assert any("--dashboard-host=127.0.0.1" in c for c in cluster["head_start_ray_commands"])
    forwarded = [o.split(" ", 1)[1] for o in cluster["docker"]["run_options"] if o.startswith("-e ")]
    assert all("=" not in o for o in forwarded if SECRETISH.search(o.split("=")[0])), (
        "secrets go by name, not value"
    )
    job = yaml.safe_load((ROOT / "infra/ray/kuberay-rayjob.yaml").read_text())
    assert job["kind"] == "RayJob" and job["spec"]["rayClusterSpec"]["authOptions"]["mode"] == "token"
    assert job["spec"]["rayClusterSpec"]["rayVersion"] == ray.__version__
    assert job["spec"]["entrypoint"].startswith("lmforge ")
