"""The autoscaling signal and manifests with the real tools: promtool checks and unit-tests the fleet's
rules; a real Prometheus (Debian's package, on loopback) scrapes two live encoder servers under a known
load, and the queries of the rules, of prometheus-adapter and of KEDA's trigger return what the
saturation formula says; the HPA and the ScaledObject validate against their schemas offline."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import math
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from encoder_server.batcher import BatchingConfig
from receiver import EncoderReceiver
from testkit import REPO_ROOT
from testkit.encoders import EncoderDouble
from testkit.images import image_bytes
from testkit.servers import running_server
from testkit.vllm_server import free_port

AUTOSCALING = REPO_ROOT / "deploy" / "autoscaling"
RULES = AUTOSCALING / "prometheus-rules.yaml"
TARGET = 0.8  # the saturation each pod is scaled to (hpa.yaml, keda.yaml, the rules)
FORWARD_S = 0.1  # each forward of the test's encoders: one item, this long
WINDOW_S = 4.0  # the servers' saturation window
RATES = {"encoder-0": 5.0, "encoder-1": 13.0}  # items per second sent to each: demand 0.5 and 1.3


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is missing: run ./scripts/setup_prometheus.sh (scripts/test.sh does)")
    return path


def manifests(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((AUTOSCALING / name).read_text()) if doc]


@pytest.mark.services
def test_promtool_checks_the_rules_and_their_unit_tests_pass(tmp_path):
    checked = subprocess.run([tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stdout + checked.stderr
    tested = subprocess.run(
        [tool("promtool"), "test", "rules", "prometheus-rules.test.yaml"],
        cwd=AUTOSCALING, capture_output=True, text=True,
    )  # fmt: skip
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr
    # The unit test is not vacuous: the same test against rules with another target fails.
    shutil.copy(AUTOSCALING / "prometheus-rules.test.yaml", tmp_path)
    (tmp_path / "prometheus-rules.yaml").write_text(RULES.read_text().replace("/ 0.8)", "/ 0.5)"))
    broken = subprocess.run(
        [tool("promtool"), "test", "rules", "prometheus-rules.test.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert broken.returncode != 0 and "desired_replicas" in broken.stdout + broken.stderr


@pytest.mark.parametrize("version", ["1.27.0", "latest"])
def test_the_hpa_and_the_adapters_config_validate_against_the_kubernetes_schemas(version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="install the test extra")
    version = kubernetes_validate.utils.latest_version() if version == "latest" else version
    docs = {doc["kind"]: doc for doc in manifests("hpa.yaml")}
    assert set(docs) == {"ConfigMap", "HorizontalPodAutoscaler"}
    for doc in docs.values():
        kubernetes_validate.validate(doc, version, strict=True)
    hpa = docs["HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "encoder_saturation"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": f"{int(TARGET * 1000)}m"}
    broken = copy.deepcopy(hpa)
    broken["spec"]["metrics"][0]["pods"]["target"]["averageValu"] = "1"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)
    (rule,) = yaml.safe_load(docs["ConfigMap"]["data"]["config.yaml"])["rules"]
    assert rule["name"]["as"] == "encoder_saturation"


def test_the_scaled_object_validates_against_kedas_crd_models():
    keda = pytest.importorskip("cloudcoil.models.keda.v1alpha1", reason="install the test extra")
    (doc,) = manifests("keda.yaml")
    parsed = keda.ScaledObject.model_validate(doc)
    # Strict: a field the CRD does not know would be dropped on the way through the model.
    assert parsed.model_dump(by_alias=True, exclude_none=True) == doc
    (trigger,) = doc["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert {"serverAddress", "query", "threshold"} <= set(trigger["metadata"])
    assert float(trigger["metadata"]["threshold"]) == TARGET
    misspelt = copy.deepcopy(doc)
    misspelt["spec"]["scaleTargetReff"] = misspelt["spec"].pop("scaleTargetRef")
    with pytest.raises(ValueError):
        keda.ScaledObject.model_validate(misspelt)
    extra = copy.deepcopy(doc)
    extra["spec"]["minReplicas"] = 2  # the HPA's name, not KEDA's
    assert keda.ScaledObject.model_validate(extra).model_dump(by_alias=True, exclude_none=True) != extra


@contextlib.contextmanager
def prometheus(targets: dict[str, int], tmp_path: Path):
    """Prometheus on 127.0.0.1 scraping `targets` (pod name -> metrics port) every second, with the
    fleet's rules evaluated every second; yields its query function once every target was scraped."""
    port = free_port()
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        group["interval"] = "1s"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(tmp_path / "rules.yaml")],
        "scrape_configs": [
            {
                "job_name": "encoder",
                "static_configs": [
                    {"targets": [f"127.0.0.1:{port}"], "labels": {"namespace": "default", "pod": pod}}
                    for pod, port in targets.items()
                ],
            }
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (tmp_path / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            tool("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip

    def query(promql: str) -> list[dict]:
        url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        reply = json.load(urllib.request.urlopen(url, timeout=5))
        assert reply["status"] == "success", reply
        return reply["data"]["result"]

    def scraped_every_target() -> bool:
        try:
            return {s["metric"]["pod"] for s in query("up == 1")} == set(targets)
        except OSError:  # not listening yet
            return False

    try:
        # Ready is not enough: its first scrapes can come seconds later, and a rate over a window that
        # they do not cover comes out low (Prometheus extrapolates only half an interval past a series' start).
        deadline = time.monotonic() + 60
        while not scraped_every_target():
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError((tmp_path / "prometheus.log").read_text()[-3000:])
            time.sleep(0.2)
        yield query
    finally:
        process.terminate()
        process.wait(30)
        log.close()


async def steady_load(url: str, rate: float, images: list[bytes], stop: asyncio.Event) -> None:
    """Single-image requests to one encoder at `rate` a second (open loop), until `stop`."""
    async with EncoderReceiver([url], timeout=120.0) as rx:
        tasks, number, started = [], 0, time.monotonic()
        while not stop.is_set():
            data = images[number]
            tasks.append(asyncio.create_task(rx.encode(f"load-{number}", [{"data": data}])))
            number += 1
            await asyncio.sleep(max(0.0, started + number / rate - time.monotonic()))
        for task in tasks:
            task.cancel()  # what is still queued leaves it
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.services
async def test_prometheus_scraping_two_loaded_encoders_gets_the_formulas_replicas(
    default_model_dir, tmp_path
):
    batching = BatchingConfig(max_batch_images=1, saturation_window_s=WINDOW_S)
    doubles = [
        EncoderDouble(tokens=4, hidden_size=64, dtype=torch.float32, forward_s=FORWARD_S) for _ in RATES
    ]
    async with contextlib.AsyncExitStack() as stack:
        servers = {
            pod: await stack.enter_async_context(
                running_server(default_model_dir, encoder=double, batching=batching, metrics_port=0)
            )
            for pod, double in zip(RATES, doubles)
        }
        query = stack.enter_context(prometheus({pod: s.metrics_port for pod, s in servers.items()}, tmp_path))
        stop = asyncio.Event()
        # Made before the load: the servers share this event loop, and their forward threads its GIL.
        images = [
            [image_bytes(16, 16, seed=1000 * n + i) for i in range(int(4 * WINDOW_S * RATES[pod]))]
            for n, pod in enumerate(RATES)
        ]
        loads = [
            asyncio.create_task(steady_load(s.url, RATES[pod], batch, stop))
            for (pod, s), batch in zip(servers.items(), images)
        ]
        try:
            await asyncio.sleep(3 * WINDOW_S)  # the window filled, and several scrapes of it
            values = await asyncio.to_thread(evaluate, query)
        finally:
            stop.set()
            await asyncio.gather(*loads)
    # The formula: forward-seconds asked per second = items per second x the seconds one item's forward
    # takes, as the encoder measured it (here FORWARD_S, plus what sharing the GIL with the test adds).
    for pod, item_s in values["item_s"].items():
        assert FORWARD_S <= item_s < 1.5 * FORWARD_S, values
    want = {pod: rate * values["item_s"][pod] for pod, rate in RATES.items()}
    for pod, value in values["per_pod"].items():
        assert value == pytest.approx(want[pod], rel=0.15), (pod, values)
    assert values["adapter"] == pytest.approx(values["per_pod"], rel=0.05)
    total = sum(want.values())
    for name in ("recorded_sum", "keda", "demand_rate"):
        assert values[name] == pytest.approx(total, rel=0.15), (name, values)
    replicas = math.ceil(total / TARGET)
    assert replicas == 3  # two pods are not enough: about 2.2 forward-seconds asked per second
    assert values["recorded_replicas"] == replicas
    assert math.ceil(values["keda"] / TARGET) == replicas
    # The HPA's: current pods x (the adapter's mean per pod / the target).
    hpa_mean = sum(values["adapter"].values()) / len(RATES)
    assert math.ceil(len(RATES) * hpa_mean / TARGET) == replicas


def evaluate(query) -> dict:
    """The autoscaling queries as the rules, prometheus-adapter and KEDA run them."""
    (config_map, _) = manifests("hpa.yaml")
    (rule,) = yaml.safe_load(config_map["data"]["config.yaml"])["rules"]
    adapter_query = (
        rule["metricsQuery"]
        .replace("<<.Series>>", "encoder_saturation")
        .replace("<<.LabelMatchers>>", 'namespace="default",pod=~"encoder-0|encoder-1"')
        .replace("<<.GroupBy>>", "pod")
    )
    (scaled_object,) = manifests("keda.yaml")
    keda_query = scaled_object["spec"]["triggers"][0]["metadata"]["query"]

    def scalar(promql: str) -> float:
        (sample,) = query(promql)
        return float(sample["value"][1])

    return {
        "item_s": {
            s["metric"]["pod"]: float(s["value"][1])
            for s in query(f"avg_over_time(encoder_item_seconds[{int(WINDOW_S)}s])")
        },
        "per_pod": {s["metric"]["pod"]: float(s["value"][1]) for s in query("encoder_saturation")},
        "adapter": {s["metric"]["pod"]: float(s["value"][1]) for s in query(adapter_query)},
        "recorded_sum": scalar("namespace_job:encoder_saturation:sum"),
        "recorded_replicas": scalar("namespace_job:encoder_desired_replicas:ceil"),
        "keda": scalar(keda_query),
        "demand_rate": scalar(f"sum(rate(encoder_demand_seconds_total[{int(2 * WINDOW_S)}s]))"),
    }
