"""LogitpoolConfig validation, YAML round trip, and the generated Serve config."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import SecretStr

from cluster.config import (
    AutoscalingConfig,
    LogitpoolConfig,
    ServerConfig,
    WorkerDeploymentConfig,
)
from cluster.deploy.serve_config import (
    APP_IMPORT_PATH,
    GRPC_SERVICER_FUNCTIONS,
    INGRESS_DEPLOYMENT,
    WORKER_DEPLOYMENT,
    deployment_options,
    main,
    render_yaml,
    serve_config,
)
from worker.config import DTYPE_NAMES, DTYPES, EngineConfig

REPO = Path(__file__).resolve().parents[2]


def _serve_schema() -> Any:
    from ray.serve.schema import ServeDeploySchema

    return ServeDeploySchema


# ---- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, fragment",
    [
        ({"engin": {}}, "engin"),  # typo at the top level
        ({"engine": {"max_num_seq": 8}}, "max_num_seq"),  # typo in a section
        ({"workers": {"autoscaling": {"max_replica": 3}}}, "max_replica"),
        ({"server": {"http_prot": 8000}}, "http_prot"),
    ],
)
def test_unknown_keys_fail(data: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        LogitpoolConfig.model_validate(data)


def test_replicas_and_autoscaling_are_exclusive() -> None:
    with pytest.raises(ValueError, match="mutually exclusive"):
        LogitpoolConfig.model_validate(
            {"workers": {"num_replicas": 2, "autoscaling": {"min_replicas": 1, "max_replicas": 3}}}
        )
    # Either one alone is fine.
    assert LogitpoolConfig.model_validate({"workers": {"num_replicas": 2}}).workers.num_replicas == 2
    auto = LogitpoolConfig.model_validate({"workers": {"autoscaling": {"max_replicas": 3}}})
    assert auto.workers.autoscaling == AutoscalingConfig(max_replicas=3)
    assert auto.workers.num_replicas is None


@pytest.mark.parametrize("section", ["workers", "ingress"])
@pytest.mark.parametrize("cpus", [1e30, float("inf"), float("nan"), -1, 1025])
def test_a_cpu_count_no_node_could_give_is_refused_by_name(section: str, cpus: float) -> None:
    """Ray would queue such a replica forever (and torch's threads follow the worker's count)."""
    with pytest.raises(ValueError, match=rf"{section}\.num_cpus"):
        LogitpoolConfig.model_validate({section: {"num_cpus": cpus}})
    assert getattr(LogitpoolConfig.model_validate({section: {"num_cpus": 2.5}}), section).num_cpus == 2.5


def test_max_ongoing_below_batch_fails_and_default_follows_batch() -> None:
    with pytest.raises(ValueError, match="max_ongoing_requests"):
        LogitpoolConfig.model_validate({"engine": {"max_num_seqs": 32}, "workers": {"max_ongoing_requests": 31}})
    ok = LogitpoolConfig.model_validate({"engine": {"max_num_seqs": 32}, "workers": {"max_ongoing_requests": 32}})
    assert ok.worker_max_ongoing_requests == 32
    assert LogitpoolConfig.model_validate({"engine": {"max_num_seqs": 48}}).worker_max_ongoing_requests == 4 * 48


@pytest.mark.parametrize(
    "server",
    [{"http_port": 0}, {"grpc_port": 65536}, {"http_port": -1}, {"http_port": 9000, "grpc_port": 9000}],
)
def test_bad_ports_fail(server: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        LogitpoolConfig.model_validate({"server": server})


@pytest.mark.parametrize(
    "data, fragment",
    [
        ({"workers": {"autoscaling": {"min_replicas": 5, "max_replicas": 2}}}, "min_replicas"),
        ({"engine": {"logits_processors": ["not a class name"]}}, "fully-qualified"),
        ({"engine": {"logits_processors": ["pkg.module.NoColon"]}}, "fully-qualified"),
        ({"engine": {"device": "gpu"}}, "device"),
        ({"engine": {"dtype": "float8"}}, "dtype"),
        ({"engine": {"max_num_seqs": 0}}, "max_num_seqs"),
        ({"engine": {"max_num_seqs": 64, "max_num_batched_tokens": 32}}, "max_num_batched_tokens"),
        ({"workers": {"num_replicas": 0}}, "num_replicas"),
        ({"workers": {"num_gpus": -1}}, "num_gpus"),
        ({"workers": {"max_queued_requests": -2}}, "max_queued_requests"),
        ({"route_prefix": "v1"}, "route_prefix"),
        ({"api_key_env": "NOT-A-NAME"}, "api_key_env"),
        ({"api_keys": [" "]}, "api_keys"),
    ],
)
def test_bad_values_fail_naming_the_field(data: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        LogitpoolConfig.model_validate(data)


def test_config_is_frozen() -> None:
    cfg = LogitpoolConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.engine.max_num_seqs = 1  # type: ignore[misc]  # assigning a frozen field is the test
    with pytest.raises(ValueError):
        cfg.app_name = "other"  # type: ignore[misc]  # assigning a frozen field is the test


def test_defaults() -> None:
    cfg = LogitpoolConfig()
    assert cfg.engine == EngineConfig()
    assert cfg.engine.model is None and cfg.engine.max_num_seqs == 64
    assert cfg.workers == WorkerDeploymentConfig() and cfg.workers.num_gpus == 0
    assert cfg.server == ServerConfig(host="127.0.0.1", http_port=8000, grpc_port=9000)
    assert (cfg.app_name, cfg.route_prefix, cfg.api_key_env) == ("logitpool", "/", "LOGITPOOL_API_KEY")


# ---- helpers for the CLI -----------------------------------------------------------------------


def test_with_overrides_merges_nested_and_dotted_keys() -> None:
    base = LogitpoolConfig.model_validate({"engine": {"max_num_seqs": 16, "seed": 3}})
    cfg = base.with_overrides(engine={"model": "gpt2"}, **{"server.http_port": 8100})
    assert cfg.engine.model == "gpt2"
    assert (cfg.engine.max_num_seqs, cfg.engine.seed) == (16, 3)  # untouched siblings kept
    assert cfg.server.http_port == 8100 and cfg.server.grpc_port == 9000
    assert base.engine.model is None  # the original is unchanged
    with pytest.raises(ValueError, match="http_port"):
        base.with_overrides(**{"server.http_port": 70000})


def test_resolve_api_keys_reads_the_named_env_var() -> None:
    cfg = LogitpoolConfig.model_validate({"api_keys": ["k1"], "api_key_env": "MY_KEYS"})
    assert cfg.resolve_api_keys({"MY_KEYS": " k2 , ,k1,k3"}) == ("k1", "k2", "k3")
    assert cfg.resolve_api_keys({"LOGITPOOL_API_KEY": "ignored"}) == ("k1",)
    assert LogitpoolConfig().resolve_api_keys({}) == ()


def test_engine_section_is_the_workers_engine_config(tmp_path: Path) -> None:
    """One engine config type: every worker field is settable from the config file, as given."""
    fields = {
        "model": "/m",
        "dtype": "float32",
        "device": "cpu",
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "max_model_len": 256,
        "max_logprobs": 5,
        "seed": 11,
        "logits_processors": ["pkg.mod:Proc"],
        "load_entry_points": False,
        "reorder_batch": False,
        "strict_extra_args": False,
        "block_size": 8,
        "kv_cache_bytes": 4096,
        "kv_cache_memory_fraction": 0.5,
        "enable_prefix_caching": False,
        "scheduling_policy": "priority",
        "attention_backend": "flex",
        "fused_layers": False,
        "packed_weights": True,
        "cuda_graphs": True,
        "async_scheduling": False,
        "stream_buffer_outputs": 8,
        "engine_process": False,
        "tensor_parallel_size": 2,
        "collective_timeout_s": 30.0,
    }
    assert set(fields) == {f.name for f in dataclasses.fields(EngineConfig)}
    cfg = LogitpoolConfig.model_validate({"engine": fields})
    assert type(cfg.engine) is EngineConfig
    assert cfg.engine == EngineConfig(**{**fields, "logits_processors": ("pkg.mod:Proc",)})
    (tmp_path / "c.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
    assert LogitpoolConfig.from_yaml(tmp_path / "c.yaml") == cfg


# ---- YAML round trip ---------------------------------------------------------------------------

_configs = st.builds(
    lambda seqs, extra, replicas, auto, gpus, port, procs, model, ranks: LogitpoolConfig.model_validate(
        {
            "engine": {
                "model": model,
                "max_num_seqs": seqs,
                "max_num_batched_tokens": seqs + extra,
                "logits_processors": procs,
                "tensor_parallel_size": ranks,
            },
            "workers": (
                {"autoscaling": {"min_replicas": auto[0], "max_replicas": auto[0] + auto[1]}, "num_gpus": gpus}
                if replicas is None
                else {"num_replicas": replicas, "num_gpus": gpus}
            ),
            "server": {"http_port": port, "grpc_port": port + 1},
        }
    ),
    st.integers(1, 512),
    st.integers(0, 4096),
    st.one_of(st.none(), st.integers(1, 16)),
    st.tuples(st.integers(0, 4), st.integers(1, 8)),
    st.sampled_from([0.0, 0.5, 1.0]),
    st.integers(1, 65534),
    st.lists(st.sampled_from(["a.b:C", "pkg.mod:Proc", "x:Y.Z"]), max_size=3),
    st.one_of(st.none(), st.sampled_from(["gpt2", "/models/qwen", "Qwen/Qwen2.5-0.5B"])),
    st.sampled_from([1, 2, 4]),
)


@settings(max_examples=40, deadline=None)
@given(cfg=_configs)
def test_yaml_round_trip(cfg: LogitpoolConfig, tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tmp_path_factory.mktemp("cfg") / "logitpool.yaml"
    path.write_text(cfg.to_yaml(), encoding="utf-8")
    assert LogitpoolConfig.from_yaml(path) == cfg


def test_yaml_keeps_secrets_out_unless_asked(tmp_path: Path) -> None:
    cfg = LogitpoolConfig(api_keys=(SecretStr("s3cret"),))
    assert "s3cret" not in cfg.to_yaml()
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml(reveal_secrets=True), encoding="utf-8")
    assert LogitpoolConfig.from_yaml(path).resolve_api_keys({}) == ("s3cret",)


def test_from_yaml_empty_and_malformed(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("", encoding="utf-8")
    assert LogitpoolConfig.from_yaml(empty) == LogitpoolConfig()
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n", encoding="utf-8")
    with pytest.raises(ValueError, match="mapping"):
        LogitpoolConfig.from_yaml(listed)


# ---- the Serve config --------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(cfg=_configs)
def test_serve_config_is_valid_and_carries_the_config(cfg: LogitpoolConfig) -> None:
    data = serve_config(cfg)
    schema = _serve_schema().model_validate(data)
    (app,) = schema.applications
    assert (app.name, app.route_prefix, app.import_path) == (cfg.app_name, cfg.route_prefix, APP_IMPORT_PATH)
    # args are exactly what the app builder validates back into the same config.
    assert LogitpoolConfig.model_validate(app.args) == cfg
    assert schema.grpc_options.grpc_servicer_functions == list(GRPC_SERVICER_FUNCTIONS)
    assert (schema.http_options.port, schema.grpc_options.port) == (cfg.server.http_port, cfg.server.grpc_port)
    deployments = {d.name: d for d in app.deployments}
    assert set(deployments) == {WORKER_DEPLOYMENT, INGRESS_DEPLOYMENT}
    worker = deployments[WORKER_DEPLOYMENT]
    assert worker.max_ongoing_requests == cfg.worker_max_ongoing_requests >= cfg.engine.max_num_seqs
    ranks = cfg.engine.tensor_parallel_size
    assert worker.ray_actor_options.num_gpus == ranks * cfg.workers.num_gpus  # the replica sees every rank's GPU
    assert worker.ray_actor_options.num_cpus == cfg.worker_cpus
    if ranks == 1:
        assert "placement_group_bundles" not in data["applications"][0]["deployments"][0]
    else:  # one bundle per rank, on one node; the replica (rank 0) in the first, with every rank's GPU
        bundles = worker.placement_group_bundles
        assert worker.placement_group_strategy == "STRICT_PACK"
        assert bundles is not None and len(bundles) == ranks
        assert [b["CPU"] for b in bundles] == [cfg.worker_cpus] * ranks
        assert [b.get("GPU", 0.0) for b in bundles] == [ranks * cfg.workers.num_gpus] + [0.0] * (ranks - 1)
    if cfg.workers.autoscaling is None:
        assert worker.num_replicas == (cfg.workers.num_replicas or 1)
        assert "autoscaling_config" not in data["applications"][0]["deployments"][0]
    else:
        assert worker.autoscaling_config == cfg.workers.autoscaling.model_dump()
        assert "num_replicas" not in data["applications"][0]["deployments"][0]


def test_serve_config_never_writes_secret_values() -> None:
    cfg = LogitpoolConfig(api_keys=(SecretStr("s3cret-value"),))
    text = render_yaml(cfg)
    assert "s3cret" not in text and "*****" not in text
    assert serve_config(cfg)["applications"][0]["args"]["api_key_env"] == "LOGITPOOL_API_KEY"


def test_deployment_options_apply_to_serve_deployments() -> None:
    from ray import serve

    @serve.deployment
    class Probe:
        pass

    cfg = LogitpoolConfig.model_validate({"workers": {"autoscaling": {"max_replicas": 3}, "num_gpus": 1}})
    for options in deployment_options(cfg).values():
        Probe.options(**options)  # raises on an option Serve does not know


def test_committed_serve_yaml_is_fresh() -> None:
    committed = (REPO / "cluster" / "serve.yaml").read_text(encoding="utf-8")
    assert committed == render_yaml(LogitpoolConfig()), (
        "regenerate: python -m cluster.deploy.serve_config -o cluster/serve.yaml"
    )


def test_main_writes_the_file_for_a_config(tmp_path: Path) -> None:
    src = tmp_path / "in.yaml"
    src.write_text("engine: {model: gpt2}\nserver: {host: 0.0.0.0}\n", encoding="utf-8")
    out = tmp_path / "serve.yaml"
    assert main(["--config", str(src), "--output", str(out)]) == 0
    data = yaml.safe_load(out.read_text(encoding="utf-8"))
    assert data == serve_config(LogitpoolConfig.from_yaml(src))
    assert data["http_options"]["host"] == "0.0.0.0"
    assert data["applications"][0]["args"]["engine"]["model"] == "gpt2"


def test_a_config_file_takes_every_dtype_name_the_engine_does() -> None:
    """One table (worker.config.DTYPE_NAMES): `fp16` and the other short names work in a file too."""
    import torch

    from worker.model.loader import _resolve_dtype

    for name, canonical in DTYPE_NAMES.items():
        assert LogitpoolConfig.model_validate({"engine": {"dtype": name}}).engine.dtype == name
        assert _resolve_dtype(name) == getattr(torch, canonical)
    assert _resolve_dtype("fp16") == torch.float16
    assert set(DTYPES) == {"auto", *DTYPE_NAMES}


def test_the_engine_config_itself_fits_every_running_row_in_a_step() -> None:
    """The rule lives in worker.config.EngineConfig; the config file and the engine inherit it."""
    with pytest.raises(ValueError, match="max_num_batched_tokens: must be >= max_num_seqs"):
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=32)
    assert EngineConfig(max_num_seqs=64, max_num_batched_tokens=64).max_num_batched_tokens == 64


@pytest.mark.parametrize(
    "kw",
    [
        {"cuda_graphs": "yes"},
        {"fused_layers": 2},
        {"enable_prefix_caching": "off"},
        {"max_num_seqs": 2.5},
        {"max_num_seqs": True},
        {"kv_cache_bytes": "1GiB"},
        {"collective_timeout_s": "60"},
    ],
)
def test_engine_keywords_of_the_wrong_type_are_refused_by_name(kw: dict[str, Any]) -> None:
    """``LLM(cuda_graphs="yes")`` must not read a string as truthy: the field is named."""
    (name,) = kw
    with pytest.raises(ValueError, match=f"^{name}: must be "):
        EngineConfig(**kw)


def test_engine_keywords_of_the_right_type_pass() -> None:
    cfg = EngineConfig(cuda_graphs=None, fused_layers=False, collective_timeout_s=5, kv_cache_bytes=2**20)
    assert cfg.collective_timeout_s == 5 and cfg.cuda_graphs is None


@pytest.mark.parametrize(
    ("workers", "ranks", "cores", "expect"),
    [
        ({}, 1, 2, 2.0),  # the embedded default on a 2-core box: both cores, not one thread
        ({}, 1, 16, 16.0),
        ({"num_replicas": 3}, 1, 16, 5.0),
        ({"num_replicas": 4}, 1, 2, 1.0),  # never below one
        ({}, 2, 8, 4.0),  # every tensor-parallel rank a share
        ({"autoscaling": {"min_replicas": 1, "max_replicas": 4}}, 1, 8, 2.0),
        ({"num_cpus": 1.5}, 1, 16, 1.5),  # as set
        ({"num_gpus": 1}, 1, 16, 1.0),  # a GPU worker does not take the host's cores
    ],
)
def test_local_worker_cpus(workers: dict[str, Any], ranks: int, cores: int, expect: float) -> None:
    cfg = LogitpoolConfig.model_validate({"workers": workers, "engine": {"tensor_parallel_size": ranks}})
    assert cfg.local_worker_cpus(cores) == expect
    assert cfg.worker_cpus == workers.get("num_cpus", 1.0)  # a cluster: 1 unless set
