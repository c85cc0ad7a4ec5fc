"""The Helm chart, offline: lint, render, validate what it renders, and prove that its
`serveConfigV2` is what `cluster.deploy.serve_config.serve_config` makes of the same settings.

No Kubernetes API server is needed: helm-python-sdk renders, KubeRay's RayService CRD
(read from ../shared/data/kuberay, never copied here) and kubernetes-validate check the objects.
"""

from __future__ import annotations

import base64
import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import LogitpoolConfig
from cluster.deploy.serve_config import serve_config

helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk renders the chart offline")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "logitpool"
GPU_VALUES = CHART / "ci" / "gpu-autoscaling-values.yaml"
TP_VALUES = CHART / "ci" / "gpu-tensor-parallel-values.yaml"
CRD = REPO.parent / "shared" / "data" / "kuberay" / "ray.io_rayservices.yaml"
RELEASE, NAMESPACE = "lp", "serving"

# The LogitpoolConfig each values file stands for, written out by hand.
DEFAULT_EQUIVALENT = {
    "engine": {
        "model": None,
        "dtype": "auto",
        "max_num_seqs": 64,
        "max_num_batched_tokens": 2048,
        "max_model_len": None,
        "max_logprobs": 20,
        "seed": 0,
        "logits_processors": [],
    },
    "workers": {
        "num_replicas": 1,
        "num_gpus": 1,
        "num_cpus": 1,
        "max_ongoing_requests": None,
        "max_queued_requests": 256,
    },
    "ingress": {"num_replicas": 1, "num_cpus": 1, "max_ongoing_requests": 1024, "max_queued_requests": 1024},
    "server": {"host": "0.0.0.0", "http_port": 8000, "grpc_port": 9000},
}
GPU_EQUIVALENT = {
    "engine": {
        "model": "/models/Qwen2.5-0.5B-Instruct",
        "dtype": "bfloat16",
        "max_num_seqs": 128,
        "max_num_batched_tokens": 8192,
        "max_model_len": 4096,
        "max_logprobs": 5,
        "seed": 7,
        "logits_processors": ["my_company.processors:BanPhrasesLogitsProcessor"],
    },
    "workers": {
        "autoscaling": {
            "min_replicas": 1,
            "max_replicas": 8,
            "target_ongoing_requests": 96,
            "upscale_delay_s": 15,
            "downscale_delay_s": 120,
            "metrics_interval_s": 2.5,
            "look_back_period_s": 20,
        },
        "num_gpus": 1,
        "num_cpus": 3.5,
        "max_ongoing_requests": 192,
        "max_queued_requests": 512,
    },
    "ingress": {"num_replicas": 2, "num_cpus": 0.5, "max_ongoing_requests": 4096, "max_queued_requests": -1},
    "server": {"host": "0.0.0.0", "http_port": 8080, "grpc_port": 50051},
}
TP_EQUIVALENT = {
    **DEFAULT_EQUIVALENT,
    "engine": {
        **DEFAULT_EQUIVALENT["engine"],
        "model": "/models/Llama-3.1-70B-Instruct",
        "dtype": "bfloat16",
        "max_model_len": 8192,
        "tensor_parallel_size": 4,
        "collective_timeout_s": 120.0,
    },
    "workers": {**DEFAULT_EQUIVALENT["workers"], "num_replicas": 2, "num_cpus": 4},
}


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    loaded = helm_python.Chart.load(CHART)
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def gpu_values() -> dict[str, Any]:
    return helm_python.values_from_yaml(GPU_VALUES.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def rayservice_schema() -> dict[str, Any]:
    if not CRD.is_file():
        pytest.skip(f"KubeRay RayService CRD not found at {CRD} (shared data beside the repository)")
    crd = yaml.safe_load(CRD.read_text(encoding="utf-8"))
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return _strict(v1["schema"]["openAPIV3Schema"])


def _strict(schema: Any) -> Any:
    """The API server's view, for plain jsonschema: unknown fields fail instead of being
    pruned, fields the server defaults are optional, and int-or-string is typed."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _strict(value) for key, value in schema.items()}
    props = out.get("properties")
    if isinstance(props, dict):
        out.setdefault("additionalProperties", False)
        if "required" in out:
            out["required"] = [name for name in out["required"] if "default" not in props.get(name, {})]
    if out.pop("x-kubernetes-int-or-string", False):
        out["type"] = ["integer", "string"]
    return out


def render(chart: Any, values: dict[str, Any] | None = None) -> dict[str, str]:
    return chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)


def objects(manifests: dict[str, str]) -> list[dict[str, Any]]:
    docs = []
    for path, text in manifests.items():
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def only(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def worker_group(rayservice: dict[str, Any]) -> dict[str, Any]:
    (group,) = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]  # one group: the workers
    return group


def container(group: dict[str, Any]) -> dict[str, Any]:
    (c,) = group["template"]["spec"]["containers"]
    return c


CASES = ["default", "gpu-autoscaling", "gpu-tensor-parallel"]


def _case_values(which: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A case's chart values and the LogitpoolConfig they stand for."""
    if which == "default":
        return {}, DEFAULT_EQUIVALENT
    path, expected = (GPU_VALUES, GPU_EQUIVALENT) if which == "gpu-autoscaling" else (TP_VALUES, TP_EQUIVALENT)
    return helm_python.values_from_yaml(path.read_text(encoding="utf-8")), expected


@pytest.fixture(scope="module", params=CASES)
def case(request: pytest.FixtureRequest, chart: Any) -> tuple[dict, list, dict]:
    values, expected = _case_values(request.param)
    return values, objects(render(chart, values)), expected


# ---- lint and schema ---------------------------------------------------------------------------


@pytest.mark.parametrize("which", CASES)
def test_lint_strict_is_clean(which: str) -> None:
    report = helm_python.lint(CHART, _case_values(which)[0], strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize(
    "typo",
    [
        {"workers": {"replica": 2}},
        {"image": {"pullPolcy": "Always"}},
        {"modle": {"name": "gpt2"}},
        {"workers": {"autoscaling": {"maxReplica": 3}}},
    ],
)
def test_a_typo_in_values_fails(chart: Any, typo: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmError, match=r"additional|not allowed|additionalProperties"):
        render(chart, typo)
    assert helm_python.lint(CHART, typo, strict=True)["errors"]


@pytest.mark.parametrize(
    "values, fragment",
    [
        ({"workers": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}}, "minReplicas"),
        ({"engine": {"maxNumSeqs": 64}, "workers": {"maxOngoingRequests": 32}}, "maxOngoingRequests"),
        ({"ports": {"http": 9000, "grpc": 9000}}, "differ"),
        ({"logitsProcessors": ["not a class"]}, "logitsProcessors"),
    ],
)
def test_invalid_settings_fail_at_render(chart: Any, values: dict[str, Any], fragment: str) -> None:
    with pytest.raises(helm_python.HelmError, match=fragment):
        render(chart, values)


# ---- what the chart renders --------------------------------------------------------------------


def test_rayservice_matches_the_kuberay_crd(case: tuple, rayservice_schema: dict[str, Any]) -> None:
    _, docs, _ = case
    jsonschema.Draft7Validator(rayservice_schema).validate(only(docs, "RayService"))


def test_crd_check_catches_a_misplaced_field(case: tuple, rayservice_schema: dict[str, Any]) -> None:
    _, docs, _ = case
    broken = copy.deepcopy(only(docs, "RayService"))
    broken["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParms"] = {}
    with pytest.raises(jsonschema.ValidationError, match="rayStartParms"):
        jsonschema.Draft7Validator(rayservice_schema).validate(broken)


def test_core_objects_and_pod_templates_are_valid_kubernetes(case: tuple) -> None:
    _, docs, _ = case
    version = kubernetes_validate.latest_version()
    core = [d for d in docs if d["kind"] != "RayService"]
    assert {d["kind"] for d in core} >= {"Service"}
    for obj in core:
        kubernetes_validate.validate(obj, version, strict=True)
    # The pod templates inside the RayService, checked as real PodTemplates.
    cluster = only(docs, "RayService")["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        pod_template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "t"},
            "template": group["template"],
        }
        kubernetes_validate.validate(pod_template, version, strict=True)


def test_serve_config_v2_equals_serve_config_of_the_same_settings(case: tuple) -> None:
    from ray.serve.schema import ServeDeploySchema

    _, docs, expected = case
    rendered = yaml.safe_load(only(docs, "RayService")["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(rendered)
    cfg = LogitpoolConfig.model_validate(expected)
    assert rendered == serve_config(cfg)


def test_head_runs_no_replicas_and_ports_are_exposed(case: tuple) -> None:
    _values, docs, expected = case
    cluster = only(docs, "RayService")["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    ports = {p["name"]: p["containerPort"] for p in container(head)["ports"]}
    server = expected["server"]
    assert ports["serve"] == server["http_port"] and ports["grpc"] == server["grpc_port"]
    assert str(ports["dashboard"]) == head["rayStartParams"]["dashboard-port"]
    assert cluster["rayVersion"] == "2.60.0"
    auth_mode = cluster["authOptions"]["mode"]
    env = {e["name"]: e for e in container(head)["env"]}
    # RAY_AUTH_MODE is explicit when auth is off (Ray >= 2.60 would turn token auth on).
    assert (env.get("RAY_AUTH_MODE", {}).get("value") == "disabled") == (auth_mode == "disabled")


def test_services_front_serve_http_and_grpc(case: tuple) -> None:
    _, docs, expected = case
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    fullname = f"{RELEASE}-logitpool"
    assert set(services) == {f"{fullname}-http", f"{fullname}-grpc"}
    for name, port in [("http", expected["server"]["http_port"]), ("grpc", expected["server"]["grpc_port"])]:
        spec = services[f"{fullname}-{name}"]["spec"]
        assert [(p["port"], p["targetPort"]) for p in spec["ports"]] == [(port, port)]
        assert spec["selector"]["ray.io/serve"] == "true"
        assert spec["selector"]["app.kubernetes.io/instance"] == RELEASE
    # Pods carry the labels the Services select on.
    cluster = only(docs, "RayService")["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        labels = group["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE


def test_scaling_bounds_drive_serve_and_pods_together(case: tuple) -> None:
    _, docs, expected = case
    rayservice = only(docs, "RayService")
    cluster = rayservice["spec"]["rayClusterConfig"]
    group = worker_group(rayservice)
    (worker,) = [
        d
        for d in yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["deployments"]
        if d["name"] == "LogitpoolWorker"
    ]
    auto = expected["workers"].get("autoscaling")
    if auto:
        assert cluster["enableInTreeAutoscaling"] is True
        assert (group["minReplicas"], group["maxReplicas"]) == (auto["min_replicas"], auto["max_replicas"])
        assert worker["autoscaling_config"]["min_replicas"] == auto["min_replicas"]
        assert worker["autoscaling_config"]["max_replicas"] == auto["max_replicas"]
    else:
        n = expected["workers"]["num_replicas"]
        assert cluster["enableInTreeAutoscaling"] is False
        assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (n, n, n)
        assert worker["num_replicas"] == n


def test_gpus_become_limits_and_a_toleration(case: tuple) -> None:
    _, docs, expected = case
    group = worker_group(only(docs, "RayService"))
    gpus = expected["workers"]["num_gpus"] * expected["engine"].get("tensor_parallel_size", 1)  # every rank's
    assert container(group)["resources"]["limits"]["nvidia.com/gpu"] == gpus
    tolerations = group["template"]["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations


# ---- single switches ---------------------------------------------------------------------------


def test_cpu_only_workers_ask_for_no_gpu(chart: Any) -> None:
    docs = objects(render(chart, {"workers": {"gpus": 0, "replicas": 3}}))
    group = worker_group(only(docs, "RayService"))
    assert "nvidia.com/gpu" not in container(group)["resources"].get("limits", {})
    assert "tolerations" not in group["template"]["spec"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (3, 3, 3)
    cfg = LogitpoolConfig.model_validate(
        {**DEFAULT_EQUIVALENT, "workers": {**DEFAULT_EQUIVALENT["workers"], "num_gpus": 0, "num_replicas": 3}}
    )
    assert yaml.safe_load(only(docs, "RayService")["spec"]["serveConfigV2"]) == serve_config(cfg)


def test_api_key_secret_created_or_referenced(chart: Any) -> None:
    def key_env(docs: list[dict[str, Any]]) -> dict[str, Any] | None:
        head = only(docs, "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]
        return {e["name"]: e for e in container(head)["env"]}.get("LOGITPOOL_API_KEY")

    open_docs = objects(render(chart))
    assert key_env(open_docs) is None and not [d for d in open_docs if d["kind"] == "Secret"]

    created = objects(render(chart, {"apiKey": {"value": "k1,k2"}}))
    secret = only(created, "Secret")
    assert base64.b64decode(secret["data"]["api-key"]).decode() == "k1,k2"
    ref = key_env(created)["valueFrom"]["secretKeyRef"]
    assert ref == {"name": secret["metadata"]["name"], "key": "api-key"}
    kubernetes_validate.validate(secret, kubernetes_validate.latest_version(), strict=True)

    existing = objects(render(chart, {"apiKey": {"existingSecret": "mine", "secretKey": "keys"}}))
    assert not [d for d in existing if d["kind"] == "Secret"]
    assert key_env(existing)["valueFrom"]["secretKeyRef"] == {"name": "mine", "key": "keys"}


def test_model_volume_and_hf_token(chart: Any, gpu_values: dict[str, Any]) -> None:
    docs = objects(render(chart, gpu_values))
    group = worker_group(only(docs, "RayService"))
    (volume,) = group["template"]["spec"]["volumes"]
    assert volume["persistentVolumeClaim"] == {"claimName": "model-weights", "readOnly": True}
    (mount,) = container(group)["volumeMounts"]
    assert (mount["mountPath"], mount["readOnly"]) == ("/models", True)
    env = {e["name"]: e for e in container(group)["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert "volumes" not in worker_group(only(objects(render(chart)), "RayService"))["template"]["spec"]


def test_notes_tell_how_to_reach_the_endpoints(chart: Any) -> None:
    notes = render(chart)["logitpool/templates/NOTES.txt"]
    fullname = f"{RELEASE}-logitpool"
    assert f"port-forward svc/{fullname}-http 8000:8000" in notes
    assert f"port-forward svc/{fullname}-grpc 9000:9000" in notes
    assert "curl" in notes and "/v1/completions" in notes
    assert "from client import Client" in notes


# ---- the Grafana dashboard ---------------------------------------------------------------------

DASHBOARD = CHART / "dashboards" / "logitpool.json"


def test_grafana_dashboard_is_off_by_default_and_a_labelled_configmap_when_on(chart: Any) -> None:
    assert not [d for d in objects(render(chart)) if d["kind"] == "ConfigMap"]
    values = {"metrics": {"grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "LLM serving"}}}}
    (cm,) = [d for d in objects(render(chart, values)) if d["kind"] == "ConfigMap"]
    kubernetes_validate.validate(cm, kubernetes_validate.latest_version(), strict=True)
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # what Grafana's sidecar looks for
    assert cm["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM serving"}
    assert json.loads(cm["data"]["logitpool.json"]) == json.loads(DASHBOARD.read_text(encoding="utf-8"))


def test_metrics_names_reach_the_serve_config(chart: Any) -> None:
    docs = objects(render(chart, {"metrics": {"names": "vllm"}}))
    app = yaml.safe_load(only(docs, "RayService")["spec"]["serveConfigV2"])["applications"][0]
    assert app["args"]["metrics"] == {"names": "vllm"}
    with pytest.raises(helm_python.HelmError, match="names"):
        render(chart, {"metrics": {"names": "prometheus"}})


def test_every_series_the_dashboard_queries_is_served() -> None:
    """Each metric name in the dashboard's queries is one /metrics serves (names: both), so no
    panel stays empty for want of a series."""
    from cluster.metrics import Metrics
    from cluster.pool_stats import PoolSnapshot
    from worker.outputs import CompletionOutput, RequestOutput

    m = Metrics(model_name="m", max_model_len=64)
    clock = m.clock(prompt_tokens=3, n=1)
    for last in (False, True):
        out = CompletionOutput(0, "x", [1], None, None, "stop" if last else None, queue_time_s=0.1 if last else None)
        clock.add(RequestOutput("r", None, [], [out], last))
    m.request("http", 200)
    m.reject("http", 400)
    kv = {"blocks_used": 1.0, "blocks_total": 2.0, "prefix_query_tokens": 4.0, "prefix_hit_tokens": 1.0}
    pool = [PoolSnapshot(True, 0.1, 1, 0, replica_id="w", kv={**kv, "num_preemptions": 0.0})]
    served = {s.name for f in text_string_to_metric_families(m.render(pool)[0].decode()) for s in f.samples}
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queried = {name for e in exprs for name in re.findall(r"(?:vllm:|logitpool_)[A-Za-z0-9_:]*", e)}
    assert len(exprs) >= 15 and queried
    assert queried <= served, sorted(queried - served)
