{{/* Names and labels. */}}
{{- define "logitpool.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped name; short, because KubeRay derives longer names from it. */}}
{{- define "logitpool.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "logitpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "logitpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "logitpool.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "logitpool.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "logitpool.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* The Secret holding accepted API keys, or "" when the API is open. */}}
{{- define "logitpool.apiKeySecretName" -}}
{{- if .Values.apiKey.existingSecret -}}
{{- .Values.apiKey.existingSecret -}}
{{- else if .Values.apiKey.value -}}
{{- printf "%s-api-key" (include "logitpool.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* Environment variable the ingress reads its API keys from (LogitpoolConfig.api_key_env). */}}
{{- define "logitpool.apiKeyEnv" -}}LOGITPOOL_API_KEY{{- end -}}

{{/* Environment shared by every Ray container. */}}
{{- define "logitpool.env" -}}
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
# Serve's HTTP proxy bounds how long a request may take to arrive (cluster/slow_clients.py).
- name: RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
  value: cluster.slow_clients:install
- name: LOGITPOOL_HTTP_READ_TIMEOUT_S
  value: {{ .Values.limits.read_timeout_s | toString | quote }}
- name: LOGITPOOL_HTTP_MAX_HEADER_BYTES
  value: {{ .Values.limits.max_header_bytes | toString | quote }}
- name: LOGITPOOL_HTTP_WRITE_STALL_S
  value: {{ .Values.limits.write_stall_timeout_s | toString | quote }}
# Serve's gRPC proxy receives and sends messages up to this size (its default is 2 GiB);
# limits.max_grpc_message_bytes, which `logitpool serve` sets likewise (cluster/cli/launch.py).
- name: RAY_SERVE_GRPC_MAX_MESSAGE_SIZE
  value: {{ max .Values.limits.max_grpc_message_bytes .Values.limits.max_body_bytes | int64 | toString | quote }}
{{- if eq .Values.ray.authMode "disabled" }}
# Ray >= 2.60 turns token auth on by default for a fresh cluster; say "disabled" explicitly.
- name: RAY_AUTH_MODE
  value: disabled
{{- end }}
{{- with (include "logitpool.apiKeySecretName" .) }}
- name: {{ include "logitpool.apiKeyEnv" $ }}
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.apiKey.secretKey }}
{{- end }}
{{- with .Values.model.hfTokenSecret.name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.model.hfTokenSecret.key }}
{{- end }}
{{- end -}}

{{/* Checks JSON Schema cannot express; the same rules as cluster/config.py. */}}
{{- define "logitpool.validate" -}}
{{- $w := .Values.workers -}}
{{- if and $w.autoscaling.enabled (gt (int $w.autoscaling.minReplicas) (int $w.autoscaling.maxReplicas)) -}}
{{- fail (printf "workers.autoscaling.minReplicas (%v) must be <= maxReplicas (%v)" $w.autoscaling.minReplicas $w.autoscaling.maxReplicas) -}}
{{- end -}}
{{- if and (not (kindIs "invalid" $w.maxOngoingRequests)) (lt (int $w.maxOngoingRequests) (int .Values.engine.maxNumSeqs)) -}}
{{- fail (printf "workers.maxOngoingRequests (%v) must be >= engine.maxNumSeqs (%v)" $w.maxOngoingRequests .Values.engine.maxNumSeqs) -}}
{{- end -}}
{{- if lt (int .Values.engine.maxNumBatchedTokens) (int .Values.engine.maxNumSeqs) -}}
{{- fail (printf "engine.maxNumBatchedTokens (%v) must be >= engine.maxNumSeqs (%v)" .Values.engine.maxNumBatchedTokens .Values.engine.maxNumSeqs) -}}
{{- end -}}
{{- if eq (int .Values.ports.http) (int .Values.ports.grpc) -}}
{{- fail "ports.http and ports.grpc must differ" -}}
{{- end -}}
{{- end -}}

{{/*
The Serve config (RayService serveConfigV2). It must equal cluster.deploy.serve_config.serve_config()
of the equivalent LogitpoolConfig: tests/deploy/test_helm_chart.py compares the two.
*/}}
{{- define "logitpool.serveConfig" -}}
{{- $v := .Values -}}
{{- $w := $v.workers -}}
{{- $a := $w.autoscaling -}}
{{- /* cluster/config.py WORKER_CALLS_PER_ROW: calls wait in the engine's fair queue, not Serve's router */ -}}
{{- $workerOngoing := $w.maxOngoingRequests | default (mul 4 $v.engine.maxNumSeqs) -}}
proxy_location: EveryNode
http_options:
  host: 0.0.0.0
  port: {{ $v.ports.http | toJson }}
grpc_options:
  port: {{ $v.ports.grpc | toJson }}
  grpc_servicer_functions:
    - cluster.grpc_servicers.add_LogitPoolServicer_to_server
    - cluster.grpc_servicers.add_HealthServicer_to_server
applications:
  - name: logitpool
    route_prefix: /
    import_path: cluster.app:app_builder
    args:
      engine:
        model: {{ $v.model.name | toJson }}
        dtype: {{ $v.model.dtype | toJson }}
        device: null
        max_num_seqs: {{ $v.engine.maxNumSeqs | toJson }}
        max_num_batched_tokens: {{ $v.engine.maxNumBatchedTokens | toJson }}
        max_model_len: {{ $v.model.maxModelLen | toJson }}
        max_logprobs: {{ $v.engine.maxLogprobs | toJson }}
        seed: {{ $v.engine.seed | toJson }}
        logits_processors: {{ $v.logitsProcessors | toJson }}
        load_entry_points: {{ $v.engine.loadEntryPoints | toJson }}
        strict_extra_args: {{ $v.engine.strictExtraArgs | toJson }}
        reorder_batch: {{ $v.engine.reorderBatch | toJson }}
        block_size: {{ $v.engine.blockSize | toJson }}
        kv_cache_bytes: {{ $v.engine.kvCacheBytes | toJson }}
        kv_cache_memory_fraction: {{ $v.engine.kvCacheMemoryFraction | toJson }}
        enable_prefix_caching: {{ $v.engine.enablePrefixCaching | toJson }}
        scheduling_policy: {{ $v.engine.schedulingPolicy | toJson }}
        attention_backend: {{ $v.engine.attentionBackend | toJson }}
        fused_layers: {{ $v.engine.fusedLayers | toJson }}
        packed_weights: {{ $v.engine.packedWeights | toJson }}
        cuda_graphs: {{ $v.engine.cudaGraphs | toJson }}
        async_scheduling: {{ $v.engine.asyncScheduling | toJson }}
        stream_buffer_outputs: {{ $v.engine.streamBufferOutputs | toJson }}
        engine_process: {{ $v.engine.engineProcess | toJson }}
        tensor_parallel_size: {{ $v.engine.tensorParallelSize | toJson }}
        collective_timeout_s: {{ $v.engine.collectiveTimeoutS | toJson }}
      workers:
        {{- if $a.enabled }}
        num_replicas: null
        autoscaling:
          {{- include "logitpool.autoscalingConfig" . | nindent 10 }}
        {{- else }}
        num_replicas: {{ $w.replicas | toJson }}
        autoscaling: null
        {{- end }}
        num_gpus: {{ $w.gpus | toJson }}
        num_cpus: {{ $w.cpus | toJson }}
        max_ongoing_requests: {{ $w.maxOngoingRequests | toJson }}
        max_queued_requests: {{ $w.maxQueuedRequests | toJson }}
        stream_interval_s: {{ $w.streamIntervalS | toJson }}
      ingress:
        num_replicas: {{ $v.ingress.replicas | toJson }}
        num_cpus: {{ $v.ingress.cpus | toJson }}
        max_ongoing_requests: {{ $v.ingress.maxOngoingRequests | toJson }}
        max_queued_requests: {{ $v.ingress.maxQueuedRequests | toJson }}
      server:
        host: 0.0.0.0
        http_port: {{ $v.ports.http | toJson }}
        grpc_port: {{ $v.ports.grpc | toJson }}
      limits: {{ $v.limits | toJson }}
      routing: {{ $v.routing | toJson }}
      metrics:
        names: {{ $v.metrics.names | toJson }}
      tool_call_parser: {{ $v.tools.callParser | toJson }}
      tool_call_constrained: {{ $v.tools.callConstrained | toJson }}
      api_key_env: {{ include "logitpool.apiKeyEnv" . }}
      app_name: logitpool
      route_prefix: /
    deployments:
      - name: LogitpoolWorker
        {{- if $a.enabled }}
        autoscaling_config:
          {{- include "logitpool.autoscalingConfig" . | nindent 10 }}
        {{- else }}
        num_replicas: {{ $w.replicas | toJson }}
        {{- end }}
        max_ongoing_requests: {{ $workerOngoing | toJson }}
        max_queued_requests: {{ $w.maxQueuedRequests | toJson }}
        # cluster/deploy/serve_config.py HEALTH_CHECK_*: a dead engine is replaced within seconds.
        health_check_period_s: 2.0
        health_check_timeout_s: 5.0
        ray_actor_options:
          num_cpus: {{ $w.cpus | toJson }}
          {{- if gt (int $v.engine.tensorParallelSize) 1 }}
          num_gpus: {{ mulf $w.gpus $v.engine.tensorParallelSize | toJson }}
          {{- else }}
          num_gpus: {{ $w.gpus | toJson }}
          {{- end }}
        {{- /* cluster/deploy/serve_config.py routing_policy: cache_aware by default when replicas can exceed 1 */ -}}
        {{- $most := ternary $a.maxReplicas $w.replicas $a.enabled -}}
        {{- $policy := $v.routing.policy | default (ternary "cache_aware" "power_of_two" (gt (int $most) 1)) -}}
        {{- if eq $policy "cache_aware" }}
        request_router_config:
          request_router_class: cluster.routing.router:CacheAwareRouter
          request_router_kwargs: {{ omit $v.routing "policy" | toJson }}
          request_routing_stats_period_s: {{ $v.routing.stats_period_s | toJson }}
        {{- end }}
        {{- if gt (int $v.engine.tensorParallelSize) 1 }}
        # cluster/deploy/serve_config.py rank_placement: one bundle per rank, all on one node; the
        # replica (rank 0) in the first, which holds every rank's GPU (the ranks are its processes).
        placement_group_bundles:
          {{- range $r := until (int $v.engine.tensorParallelSize) }}
          - CPU: {{ $w.cpus | toJson }}
            {{- if and (eq $r 0) (gt (float64 $w.gpus) 0.0) }}
            GPU: {{ mulf $w.gpus $v.engine.tensorParallelSize | toJson }}
            {{- end }}
          {{- end }}
        placement_group_strategy: STRICT_PACK
        {{- end }}
      - name: LogitpoolIngress
        num_replicas: {{ $v.ingress.replicas | toJson }}
        max_ongoing_requests: {{ $v.ingress.maxOngoingRequests | toJson }}
        max_queued_requests: {{ $v.ingress.maxQueuedRequests | toJson }}
        ray_actor_options:
          num_cpus: {{ $v.ingress.cpus | toJson }}
{{- end -}}

{{- define "logitpool.autoscalingConfig" -}}
{{- $a := .Values.workers.autoscaling -}}
min_replicas: {{ $a.minReplicas | toJson }}
max_replicas: {{ $a.maxReplicas | toJson }}
target_ongoing_requests: {{ $a.targetOngoingRequests | toJson }}
upscale_delay_s: {{ $a.upscaleDelayS | toJson }}
downscale_delay_s: {{ $a.downscaleDelayS | toJson }}
metrics_interval_s: {{ $a.metricsIntervalS | toJson }}
look_back_period_s: {{ $a.lookBackPeriodS | toJson }}
{{- end -}}

{{/* Pod-level scheduling for one group: nodeSelector and tolerations. */}}
{{- define "logitpool.podScheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
