"""The deployment files: the Kubernetes manifests validate against Kubernetes' own
schemas (the kubernetes-validate package; no cluster runs here), and every command
in them, in the Swarm stack and in the compose file is one our programs accept,
with the settings that make drains and membership work."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from engine_worker.__main__ import build_parser as engine_parser
from frontend.__main__ import build_parser as frontend_parser
from kv_store.__main__ import build_parser as kv_store_parser
from roseserve.cli import build_parser as roseserve_parser
from roseserve.healthcheck import build_parser as healthcheck_parser
from tokenizer_worker.__main__ import build_parser as tokenizer_parser

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
KUBERNETES_VERSION = "1.31"
PARSERS = {"engine_worker": engine_parser, "frontend": frontend_parser, "kv_store": kv_store_parser,
           "tokenizer_worker": tokenizer_parser, "roseserve.healthcheck": healthcheck_parser,
           "roseserve": roseserve_parser}


def parse(command: list[str]):
    """``python -m MODULE ARGS...`` parsed by MODULE's own parser (argparse exits on
    anything it refuses)."""
    assert command[:2] == ["python", "-m"], command
    return PARSERS[command[2]]().parse_args(command[3:])


def manifests() -> dict[str, dict]:
    """Every object, by kind/name."""
    out = {}
    for path in KUBERNETES:
        for doc in yaml.safe_load_all(path.read_text()):
            out[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return out


def containers(doc: dict) -> list[dict]:
    return doc["spec"]["template"]["spec"]["containers"]


@pytest.mark.parametrize("path", KUBERNETES, ids=lambda p: p.name)
def test_the_manifests_validate_against_the_kubernetes_schemas(path):
    docs = list(yaml.safe_load_all(path.read_text()))
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_manifest_error_is_caught():
    """The validation is not vacuous: a misspelt field and a wrong type fail it."""
    deployment = manifests()["Deployment/engine"]
    bad = yaml.safe_load(yaml.safe_dump(deployment))
    bad["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)
    bad = yaml.safe_load(yaml.safe_dump(deployment))
    bad["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "45s"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_the_kubernetes_commands_and_probes_are_ours_and_drain_within_the_grace_period():
    objects = manifests()
    engine_service = objects["Service/engine"]
    assert engine_service["spec"]["clusterIP"] == "None"  # DNS answers with every pod
    for name in ("Deployment/engine", "Deployment/engine-gpu"):
        deployment = objects[name]
        (container,) = containers(deployment)
        args = parse(container["command"])
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert args.drain_timeout + 10 <= grace, name
        assert container["readinessProbe"]["exec"]["command"][-1] == "--ready"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            check = parse(container[probe]["exec"]["command"])
            assert (check.kind, check.address) == ("engine", "tcp://127.0.0.1:5557"), probe
        assert "kill -TERM 1" in container["lifecycle"]["preStop"]["exec"]["command"][-1]
        # Both engine Deployments sit behind the one Service, each owning its own pods.
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert engine_service["spec"]["selector"].items() <= labels.items()
        assert deployment["spec"]["selector"]["matchLabels"] == labels
    gpu = containers(objects["Deployment/engine-gpu"])[0]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert parse(gpu["command"]).device == "cuda"
    cpu_labels = objects["Deployment/engine"]["spec"]["selector"]["matchLabels"]
    gpu_labels = objects["Deployment/engine-gpu"]["spec"]["selector"]["matchLabels"]
    assert cpu_labels["roseserve/accelerator"] != gpu_labels["roseserve/accelerator"]
    (front,) = containers(objects["Deployment/frontend"])
    args = parse(front["command"])
    assert args.engine == ["tcp://engine:5557"] and args.tokenizer == "tcp://tokenizer:5558"
    # The preStop pause, then the drain, within the grace period.
    pause = int(front["lifecycle"]["preStop"]["exec"]["command"][-1].split()[-1])
    grace = objects["Deployment/frontend"]["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"]
    assert pause + args.drain_timeout + 10 <= grace
    assert objects["Deployment/frontend"]["spec"]["replicas"] >= 2
    # The engines use the shared KV store, one pod behind a headless Service.
    (store,) = containers(objects["Deployment/kv-store"])
    assert parse(store["command"]).bind == "tcp://0.0.0.0:5559"
    assert objects["Service/kv-store"]["spec"]["clusterIP"] == "None"
    for probe in ("readinessProbe", "livenessProbe"):
        check = parse(store[probe]["exec"]["command"])
        assert (check.kind, check.address) == ("kv-store", "tcp://127.0.0.1:5559")
    for name in ("Deployment/engine", "Deployment/engine-gpu"):
        env = {e["name"]: e.get("value") for e in containers(objects[name])[0]["env"]}
        assert env.get("ROSESERVE_KV_STORE_ADDRESS") == "tcp://kv-store:5559", name
    (tokenizer,) = containers(objects["Deployment/tokenizer"])
    assert parse(tokenizer["command"]).bind == "tcp://0.0.0.0:5558"
    assert objects["Service/tokenizer"]["spec"]["clusterIP"] == "None"
    # Every process holds the cluster's CURVE key, from the Secret, readable by the
    # image's user through the pod's fsGroup.
    for name, deployment in objects.items():
        if not name.startswith("Deployment/"):
            continue
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert env["ROSESERVE_CURVE_KEY_FILE"] == mounts["cluster-key"] + "/cluster.key", name
        assert volumes["cluster-key"]["secret"]["secretName"] == "roseserve-cluster-key", name
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"], name


def interpolated(text: str) -> str:
    """A compose file's ${VAR:-default} and ${VAR-default} replaced by the default."""
    return re.sub(r"\$\{[A-Z_]+:?-([^}]*)\}", r"\1", text)


def test_the_swarm_stack_and_the_compose_file_run_our_commands():
    stack = yaml.safe_load(interpolated((ROOT / "deploy/swarm/stack.yml").read_text()))
    services = stack["services"]
    frontend = parse(services["frontend"]["command"])
    assert frontend.engine == ["tcp://tasks.engine:5557"]
    engine = parse(services["engine"]["command"])
    for name, args in (("engine", engine), ("frontend", frontend)):
        assert args.drain_timeout + 10 <= int(services[name]["stop_grace_period"].rstrip("s"))
    assert services["engine"]["deploy"]["update_config"]["parallelism"] == 1
    assert parse(services["kv-store"]["command"]).bind == "tcp://0.0.0.0:5559"
    assert services["engine"]["environment"]["ROSESERVE_KV_STORE_ADDRESS"] == \
        "tcp://kv-store:5559"
    assert int(services["frontend"]["deploy"]["replicas"]) >= 2
    for service in services.values():
        parse(service["command"])
        parse(service["healthcheck"]["test"][1:])
        # The cluster key, from the Swarm secret, for every process.
        (secret,) = service["secrets"]
        assert service["environment"]["ROSESERVE_CURVE_KEY_FILE"] == \
            f"/run/secrets/{secret['target']}"
    assert stack["secrets"][secret["source"]] == {"external": True}
    compose = yaml.safe_load(interpolated((ROOT / "docker-compose.yml").read_text()))
    keygen = parse(compose["services"]["keygen"]["command"])
    assert parse(compose["services"]["kv-store"]["command"]).bind == "tcp://0.0.0.0:5559"
    for name in ("engine-0", "engine-1"):
        assert compose["services"][name]["environment"]["ROSESERVE_KV_STORE_ADDRESS"] == \
            "tcp://kv-store:5559"
    for name, service in compose["services"].items():
        if "command" in service and name != "keygen":
            drain = getattr(parse(service["command"]), "drain_timeout", None)
            if drain is not None:  # the frontends' and the engines'
                assert drain + 10 <= int(service["stop_grace_period"].rstrip("s")), name
            parse(service["healthcheck"]["test"][1:])
            # Each waits for the key the keygen service writes, and reads it.
            assert service["depends_on"]["keygen"]["condition"] == \
                "service_completed_successfully", name
            assert service["environment"]["ROSESERVE_CURVE_KEY_FILE"] == keygen.file, name
            assert "cluster-key:/keys:ro" in service["volumes"], name
