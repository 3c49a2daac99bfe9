"""docs/deploy.md's Kubernetes manifests (replicas behind the Gateway API inference extension):
valid YAML, the API versions and kinds the extension defines, and the fields the page relies
on agreeing with each other and with radixlora: the pod's command line parses as `radixlora
serve` flags, the pool selects the Deployment's pods on its port, probes and grace period fit
the drain, and the metrics the endpoint picker reads are the ones `--vllm-metric-names`
exports. Not run against a cluster."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from radixlora.cli import build_parser
from radixlora.server.http.metrics import Metrics
from radixlora.server.messages import SchedulerStats

DEPLOY = Path(__file__).resolve().parents[1] / "docs" / "deploy.md"
SECTION = "## Replicas behind the Gateway API inference extension"
POOL_API = "inference.networking.k8s.io/v1"
OBJECTIVE_API = "inference.networking.x-k8s.io/v1alpha2"
PICKER_METRICS = ("vllm:num_requests_waiting", "vllm:num_requests_running",
                  "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                  "vllm:lora_requests_info")


def section_text() -> str:
    text = DEPLOY.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start:] if end < 0 else text[start:end]


@pytest.fixture(scope="module")
def manifests() -> dict[str, list[dict]]:
    """kind -> the documents of that kind, from every yaml block of the section."""
    blocks = re.findall(r"```yaml\n(.*?)```", section_text(), re.S)
    docs = [doc for block in blocks for doc in yaml.safe_load_all(block) if doc]
    out: dict[str, list[dict]] = {}
    for doc in docs:
        out.setdefault(doc["kind"], []).append(doc)
    return out


def one(manifests, kind: str) -> dict:
    [doc] = manifests[kind]
    return doc


def test_every_kind_is_there_with_the_extension_api_versions(manifests):
    assert set(manifests) == {"Deployment", "Service", "InferencePool", "HTTPRoute",
                              "InferenceObjective"}
    assert one(manifests, "InferencePool")["apiVersion"] == POOL_API
    assert {o["apiVersion"] for o in manifests["InferenceObjective"]} == {OBJECTIVE_API}
    assert one(manifests, "HTTPRoute")["apiVersion"] == "gateway.networking.k8s.io/v1"


def container(manifests) -> dict:
    [c] = one(manifests, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def serve_flags(manifests):
    c = container(manifests)
    assert c["command"] == ["radixlora"]
    return build_parser().parse_args(c["args"])


def test_the_pod_command_line_is_valid_radixlora_serve_flags(manifests):
    flags = serve_flags(manifests)
    assert flags.func.__name__ == "serve"
    assert flags.vllm_metric_names and flags.host == "0.0.0.0"
    assert flags.adapter_dir == "/adapters"
    port = container(manifests)["ports"][0]["containerPort"]
    assert flags.port == port


def test_the_pool_selects_the_pods_on_their_port(manifests):
    deployment = one(manifests, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    pool = one(manifests, "InferencePool")["spec"]
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert one(manifests, "Service")["spec"]["selector"].items() <= labels.items()
    assert [p["number"] for p in pool["targetPorts"]] == [serve_flags(manifests).port]
    picker = pool["endpointPickerRef"]
    assert picker["name"] and picker["port"]["number"] == 9002
    assert picker["failureMode"] in ("FailOpen", "FailClose")


def test_the_route_and_objectives_reference_the_pool(manifests):
    pool = one(manifests, "InferencePool")["metadata"]["name"]
    [rule] = one(manifests, "HTTPRoute")["spec"]["rules"]
    [backend] = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io", "InferencePool", pool)
    for objective in manifests["InferenceObjective"]:
        assert objective["spec"]["poolRef"] == {"group": "inference.networking.k8s.io",
                                                "name": pool}
        assert isinstance(objective["spec"]["priority"], int)


def test_probes_and_grace_period_fit_the_drain(manifests):
    c = container(manifests)
    port = serve_flags(manifests).port
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": port}
    assert c["startupProbe"]["httpGet"] == {"path": "/health", "port": port}
    assert c["livenessProbe"]["tcpSocket"] == {"port": port}  # a draining pod stays alive
    grace = one(manifests, "Deployment")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"]
    assert grace > serve_flags(manifests).drain_timeout


def test_the_picker_reads_metrics_radixlora_exports():
    metrics = Metrics(vllm_names=True)
    metrics.on_stats(SchedulerStats(kv_capacity=100, kv_used=25, kv_cached=0, running=3,
                                    waiting=2, prompt_tokens=0, cached_tokens=0,
                                    running_adapters=["sql", "legal"], max_loras=16))
    text = metrics.render().decode()
    values = dict(re.findall(r"^(vllm:\w+) (\S+)$", text, re.M))
    assert values["vllm:num_requests_waiting"] == "2.0"
    assert values["vllm:num_requests_running"] == "3.0"
    assert values["vllm:kv_cache_usage_perc"] == values["vllm:gpu_cache_usage_perc"] == "0.25"
    assert ('vllm:lora_requests_info{max_lora="16",running_lora_adapters="sql,legal",'
            'waiting_lora_adapters=""}') in text
    for name in PICKER_METRICS:
        assert name in section_text()
