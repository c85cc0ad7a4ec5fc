"""`logitpool bench soak`: many requests with faults mixed in; every request must end exactly once.

The load (over HTTP and gRPC, ``--concurrency`` clients at a time):
- random valid requests (the innocents): completions, chat and gRPC, streamed or not, with
  random sampling parameters;
- 10 % hostile requests (the hardening issue's repros), each expecting a 4xx /
  ``INVALID_ARGUMENT`` with a JSON error body, or a valid answer where one exists;
- 10 % streams the client cancels after the first chunk;
- 1 % enabling ``FaultInjectionProcessor`` (a processor that raises for that request alone);
- issue 17's hostile classes, each bounded in count (cluster/cli/soak_classes.py says what each may
  end with): amplifying completions, heavy-grammar pairs, hogs at the sequence limits, and
  streams whose client stops reading; some innocents carry fresh trivial constraints;
- one worker replica killed (SIGKILL) halfway through.
Checks: every request ends with exactly one outcome it was allowed, within its timeout; no
innocent fails except those in flight on the killed replica; every replica's batch is empty at
the end; the surviving worker replica's and the ingress's RSS after warm-up grow < 5 %.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import glob
import json
import os
import random
import signal
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc
import httpx

from client import AsyncClient, InternalError, LogitpoolError, Unavailable
from cluster.cli import soak_classes as sc
from cluster.cli.soak_classes import (  # noqa: F401 - the kinds and outcomes, re-exported for callers
    ALLOWED,
    AMPLIFY,
    CANCEL,
    CANCELLED,
    FAULT,
    FAULTED,
    HEAVY_GRAMMAR,
    HOG,
    HOSTILE,
    HOSTILE_HTTP,
    INNOCENT,
    OK,
    REJECTED,
    STALL,
    STALLED,
    UNAVAILABLE,
    UNEXPECTED,
    WORDS,
    grpc_hostile,
    nested_extra_args_request,
)
from cluster.config import LogitpoolConfig
from cluster.limits import Limits
from worker.bench.faults import FQCN as FAULT_FQCN

WORKER_DEPLOYMENT = "LogitpoolWorker"
INGRESS_DEPLOYMENT = "LogitpoolIngress"
RSS_GROWTH_LIMIT = 0.05
CONSTRAINED_SHARE = 0.1  # of innocents: a fresh trivial constraint each
REQUEST_TIMEOUT_S = 120.0


@dataclass
class Outcome:
    kind: str
    name: str  # transport and shape, or the hostile case's name
    result: str
    detail: str = ""
    start: float = 0.0
    end: float = 0.0


@dataclass
class SoakReport:
    outcomes: list[Outcome]
    kill_time: float | None = None
    killed_in_flight: int | None = None  # the killed replica's running + waiting just before the kill
    rss_warm: dict[int, int] = field(default_factory=dict)  # pid -> bytes after warm-up
    rss_end: dict[int, int] = field(default_factory=dict)
    roles: dict[int, str] = field(default_factory=dict)  # pid -> "worker" / "ingress"
    died: list[int] = field(default_factory=list)  # worker pids after warm-up gone at the end
    leftover: dict[str, int] = field(default_factory=dict)  # replica -> sequences still running at the end
    seconds: float = 0.0

    def table(self) -> dict[tuple[str, str], int]:
        return dict(collections.Counter((o.kind, o.result) for o in self.outcomes))

    def excused(self, o: Outcome) -> bool:
        """An innocent lost on the killed replica: started before the kill, ended after it."""
        return (
            o.result == UNAVAILABLE
            and self.kill_time is not None
            and o.start <= self.kill_time + 1.0
            and o.end >= self.kill_time
        )

    def violations(self) -> list[str]:
        allowed = ALLOWED
        bad = [
            f"{o.kind}/{o.name}: {o.result} ({o.detail[:200]})"
            for o in self.outcomes
            if o.result not in allowed[o.kind] and not self.excused(o)
        ]
        excused = sum(1 for o in self.outcomes if o.result not in allowed[o.kind] and self.excused(o))
        if self.killed_in_flight is not None and excused > self.killed_in_flight + 8:
            bad.append(f"{excused} requests failed at the kill; the replica held {self.killed_in_flight}")
        if len(self.died) > (self.kill_time is not None):
            killed = "one was" if self.kill_time is not None else "none was"
            bad.append(f"worker pids {self.died} are gone at the end; {killed} killed")
        for replica, n in self.leftover.items():
            if n:
                bad.append(f"replica {replica}: {n} sequences still in its batch after the load")
        for pid, warm in self.rss_warm.items():
            end = self.rss_end.get(pid)
            if end is not None and end > warm * (1 + RSS_GROWTH_LIMIT):
                bad.append(f"{self.roles.get(pid, 'worker')} pid {pid}: RSS grew {end / warm - 1:+.1%} after warm-up")
        return bad

    def innocent_latency(self, kind: str | None) -> tuple[int, float, float] | None:
        """(count, median s, max s) of the innocents overlapping a request of ``kind`` (None:
        those overlapping none of the new classes); None when there are none."""
        spans = [(o.start, o.end) for o in self.outcomes if o.kind in ((kind,) if kind else sc.NEW_CLASSES)]

        def overlaps(o: Outcome) -> bool:
            return any(o.start < end and start < o.end for start, end in spans)

        lat = [
            o.end - o.start
            for o in self.outcomes
            if o.kind == INNOCENT and o.result == OK and overlaps(o) == (kind is not None)
        ]
        return (len(lat), statistics.median(lat), max(lat)) if lat else None

    def render(self) -> str:
        lines = ["| kind | outcome | requests |", "|---|---|---|"]
        for (kind, result), n in sorted(self.table().items()):
            lines.append(f"| {kind} | {result} | {n} |")
        by_name = collections.Counter((o.kind, o.name, o.result) for o in self.outcomes if o.kind in sc.NEW_CLASSES)
        if by_name:
            lines += ["", "| hostile class | request | outcome | requests |", "|---|---|---|---|"]
            lines += [f"| {kind} | {name} | {result} | {n} |" for (kind, name, result), n in sorted(by_name.items())]
        lines.append(f"\n{len(self.outcomes)} requests in {self.seconds:.1f} s")
        if self.kill_time is not None:
            lost = sum(1 for o in self.outcomes if o.kind == INNOCENT and self.excused(o))
            lines.append(
                f"replica killed at {self.kill_time:.1f} s holding {self.killed_in_flight} sequences; "
                f"innocents lost with it: {lost}"
            )
        for pid, warm in self.rss_warm.items():
            if pid in self.rss_end:
                lines.append(
                    f"{self.roles.get(pid, 'worker')} pid {pid}: RSS {warm / 2**20:.0f} -> "
                    f"{self.rss_end[pid] / 2**20:.0f} MiB ({self.rss_end[pid] / warm - 1:+.1%})"
                )
        slowest = sorted(self.outcomes, key=lambda o: o.start - o.end)[:5]
        lines.append("slowest: " + ", ".join(f"{o.kind}/{o.name} {o.result} {o.end - o.start:.1f} s" for o in slowest))
        for alongside in (None, *sc.NEW_CLASSES):
            if (lat := self.innocent_latency(alongside)) is not None:
                lines.append(
                    f"innocents {'alongside ' + alongside if alongside else 'alongside none of them'}: "
                    f"{lat[0]}, median {lat[1]:.2f} s, max {lat[2]:.2f} s"
                )
        return "\n".join(lines)


# -- request makers --------------------------------------------------------------------------


def random_sampling(rng: random.Random, vocab: int) -> dict[str, Any]:
    """Valid sampling fields (names shared by HTTP and gRPC)."""
    s: dict[str, Any] = {"max_tokens": rng.randint(1, 12)}
    if rng.random() < 0.4:
        s["temperature"] = 0.0
    else:
        s["temperature"] = round(rng.uniform(0.3, 1.5), 2)
        if rng.random() < 0.4:
            s["top_p"] = round(rng.uniform(0.5, 1.0), 2)
        if rng.random() < 0.4:
            s["top_k"] = rng.randint(1, 50)
        if rng.random() < 0.3:
            s["min_p"] = round(rng.uniform(0.0, 0.2), 3)
    if rng.random() < 0.5:
        s["seed"] = rng.randint(-(2**63), 2**63 - 1)
    if rng.random() < 0.2:
        s["stop"] = [rng.choice(WORDS)]
    if rng.random() < 0.2:
        s["bad_words"] = [rng.choice(WORDS)]
    if rng.random() < 0.2:
        s["logit_bias"] = {str(rng.randrange(vocab)): rng.uniform(-5, 5)}
    if rng.random() < 0.2:
        s["repetition_penalty"] = round(rng.uniform(0.8, 1.5), 2)
    if rng.random() < 0.2:
        s["presence_penalty"] = round(rng.uniform(-1, 1), 2)
    if rng.random() < 0.2:
        s["min_tokens"] = rng.randint(0, s["max_tokens"])
    if rng.random() < 0.2:
        s["ignore_eos"] = True
    return s


def random_prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 24)))


# -- one request each -----------------------------------------------------------------------


def _http_result(status: int, text: str, ok_statuses: tuple[int, ...]) -> tuple[str, str]:
    """A response body must be JSON (SSE events too); 4xx in the allowed set is a rejection."""
    try:
        if text.startswith("data: "):
            for line in text.splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    json.loads(line[6:], parse_constant=_reject_constant)
        else:
            json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        return UNEXPECTED, f"{status}: body is not strict JSON ({exc}): {text[:120]!r}"
    if status not in ok_statuses:
        return (UNAVAILABLE if status == 503 else UNEXPECTED), f"status {status}: {text[:200]}"
    return (OK if status == 200 else REJECTED), str(status)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


async def http_request(
    hc: httpx.AsyncClient,
    base: str,
    path: str,
    body: Any,
    headers: dict[str, str],
    ok_statuses: tuple[int, ...] = (200,),
) -> tuple[str, str]:
    content = body if isinstance(body, str) else json.dumps(body)
    hdrs = {"content-type": "application/json", **headers}
    r = await hc.post(f"{base}{path}", content=content.encode("utf-8", "surrogatepass"), headers=hdrs)
    result, detail = _http_result(r.status_code, r.text, ok_statuses)
    if result == OK and r.text.startswith("data: "):
        # A stream that already sent 200 reports failures as an error event.
        events = [
            json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"
        ]
        errors = [e["error"] for e in events if "error" in e]
        if errors:
            code = errors[0].get("code")
            return (UNAVAILABLE if code == 503 else FAULTED if code == 500 else UNEXPECTED), json.dumps(errors[0])[:200]
    return result, detail


async def http_cancelled_stream(hc: httpx.AsyncClient, base: str, body: dict[str, Any]) -> tuple[str, str]:
    async with hc.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return _http_result(r.status_code, (await r.aread()).decode(), (200,))
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                return CANCELLED, "closed after the first event"
    return OK, "finished before the first event"


async def grpc_request(gc: AsyncClient, prompt: str, sampling: dict[str, Any], stream: bool) -> tuple[str, str]:
    try:
        if stream:
            chunks = [ch async for ch in gc.stream(prompt, **sampling)]
            errors = [ch.error for ch in chunks if ch.error]
            return (FAULTED, errors[0]) if errors else (OK, f"{len(chunks)} chunks")
        out = await gc.generate(prompt, **sampling)
        return (FAULTED, out.error) if out.error else (OK, out.finish_reason or "")
    except InternalError as exc:
        return FAULTED, str(exc)
    except LogitpoolError as exc:
        return _grpc_outcome(exc.code, str(exc)), f"{exc.code}: {exc}"


async def grpc_cancelled_stream(gc: AsyncClient, prompt: str, sampling: dict[str, Any]) -> tuple[str, str]:
    stream = gc.stream(prompt, **sampling)
    try:
        async for _ in stream:
            return CANCELLED, "closed after the first chunk"
    except Unavailable as exc:
        return UNAVAILABLE, str(exc)
    finally:
        await stream.aclose()
    return OK, "no chunk"


# -- the load -------------------------------------------------------------------------------


def _grpc_outcome(code: grpc.StatusCode | None, details: str) -> str:
    """INVALID_ARGUMENT with a message free of internal class names is a rejection; else a surprise."""
    if code == grpc.StatusCode.INVALID_ARGUMENT and details and "<class" not in details:
        return REJECTED
    return UNAVAILABLE if code == grpc.StatusCode.UNAVAILABLE else UNEXPECTED


@dataclass
class _Load:
    """The clients and request makers one soak run shares across its requests."""

    hc: httpx.AsyncClient
    gc: AsyncClient
    base: str
    vocab: int
    hostile_grpc: list[tuple[str, Callable[[AsyncClient], Awaitable[Any]]]]
    limits: Limits = field(default_factory=Limits)
    stall_hold_s: float = 3.0

    async def send(self, kind: str, r: random.Random, ordinal: int = 0) -> tuple[str, str, str]:
        """The ``ordinal``-th request of ``kind``: (name, outcome, detail); never raises, never
        waits unbounded."""
        try:
            return await asyncio.wait_for(self._send(kind, r, ordinal), REQUEST_TIMEOUT_S)
        except TimeoutError:
            return kind, UNEXPECTED, f"no answer within {REQUEST_TIMEOUT_S:.0f} s"
        except Exception as exc:  # noqa: BLE001 - any client-side surprise is one request's outcome
            return kind, UNEXPECTED, f"{type(exc).__name__}: {exc}"

    async def _send(self, kind: str, r: random.Random, ordinal: int) -> tuple[str, str, str]:
        new_class = {
            AMPLIFY: self._amplify,
            HEAVY_GRAMMAR: self._heavy_grammar,
            HOG: self._hog,
            STALL: self._stall,
        }.get(kind)
        if new_class is not None:
            return await new_class(r, ordinal)
        hc, gc, base = self.hc, self.gc, self.base
        prompt, sampling = random_prompt(r), random_sampling(r, self.vocab)
        if kind == HOSTILE:
            return await self._hostile(r)
        if kind == CANCEL:
            sampling["max_tokens"] = 64
            sampling["ignore_eos"] = True
            if r.random() < 0.5:
                return "http_stream", *(await http_cancelled_stream(hc, base, {"prompt": prompt, **sampling}))
            return "grpc_stream", *(await grpc_cancelled_stream(gc, prompt, sampling))
        if kind == FAULT:
            sampling["extra_args"] = {"fault": r.choice(["apply", "update_state", "nan"])}
            sampling["ignore_eos"] = True
            sampling["min_tokens"] = sampling["max_tokens"] = max(2, sampling["max_tokens"])
        elif r.random() < CONSTRAINED_SHARE:
            # Plain sampling only: bad_words or logit_bias could leave a grammar nothing to allow.
            sampling = {k: v for k, v in sampling.items() if k in ("max_tokens", "temperature", "top_p", "seed")}
            sampling["structured_outputs"] = sc.trivial_constraint(r)
        shape = r.choice(["http_completion", "http_chat", "http_stream", "grpc", "grpc_stream"])
        suffix = "_constrained" if "structured_outputs" in sampling else ""
        if shape.startswith("grpc"):
            return shape + suffix, *(await grpc_request(gc, prompt, sampling, stream=shape == "grpc_stream"))
        if shape == "http_chat":
            body = {"messages": [{"role": "user", "content": prompt}], **sampling}
            if "extra_args" in body:
                body["vllm_xargs"] = body.pop("extra_args")
            result, detail = await http_request(hc, base, "/v1/chat/completions", body, {})
        else:
            body = {"prompt": prompt, **sampling, "stream": shape == "http_stream"}
            result, detail = await http_request(hc, base, "/v1/completions", body, {})
        if kind == FAULT and result == UNEXPECTED and detail.startswith("status 500"):
            result = FAULTED  # a non-streamed request whose processor failed: 500 with a JSON error body
        return shape + suffix, result, detail

    async def _hostile(self, r: random.Random) -> tuple[str, str, str]:
        if r.random() < 0.25:
            name, call = r.choice(self.hostile_grpc)
            code: grpc.StatusCode | None
            try:
                await call(self.gc)
                return name, OK, ""
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details() or ""
            except LogitpoolError as exc:
                code, details = exc.code, str(exc)
            return name, _grpc_outcome(code, details), f"{code}: {details}"
        name, path, body, headers, ok = r.choice(HOSTILE_HTTP)
        return name, *(await http_request(self.hc, self.base, path, body, headers, ok))

    async def _post(self, body: dict[str, Any]) -> sc.Answer:
        r = await self.hc.post(f"{self.base}/v1/completions", json=body)
        return sc.http_answer(r.status_code, r.content)

    async def _amplify(self, r: random.Random, ordinal: int) -> tuple[str, str, str]:
        name, body = sc.amplify_body(r, ordinal)
        return name, *sc.classify(sc.AMPLIFY_RULE, await self._post(body))

    async def _heavy_grammar(self, r: random.Random, ordinal: int) -> tuple[str, str, str]:
        so = {"json": sc.heavy_schema(r.randrange(10**9))}
        if ordinal % 2:
            try:
                out = await self.gc.generate("x", max_tokens=4, structured_outputs=so)
                answer = sc.Answer(500, out.error) if out.error else sc.Answer(200)
            except LogitpoolError as exc:
                answer = sc.grpc_answer(exc.code, str(exc))
            return "grpc_heavy_grammar", *sc.classify(sc.HEAVY_GRAMMAR_RULE, answer)
        answer = await self._post({"prompt": "x", "max_tokens": 4, "structured_outputs": so})
        return "http_heavy_grammar", *sc.classify(sc.HEAVY_GRAMMAR_RULE, answer)

    async def _hog(self, r: random.Random, ordinal: int) -> tuple[str, str, str]:
        seq_limit = getattr(self.limits, "max_sequences_per_request", None)
        shapes = sc.hog_shapes(self.limits.max_prompts, self.limits.max_n, seq_limit)
        name, shape = shapes[ordinal % len(shapes)]
        answer = await self._post(sc.hog_body(r, shape))
        return f"{name}_{shape.sequences}", *sc.classify(sc.hog_rule(shape, seq_limit), answer)

    async def _stall(self, r: random.Random, ordinal: int) -> tuple[str, str, str]:
        prompt = random_prompt(r)
        if ordinal % 2:
            return "grpc_stall", *(await sc.stalled_grpc_stream(self.gc, prompt, self.stall_hold_s))
        body = {"prompt": prompt, **sc.STALL_SAMPLING}
        return "http_stall", *(await sc.stalled_http_stream(self.base, body, self.stall_hold_s))


async def run_soak(
    http_base: str,
    grpc_target: str,
    *,
    requests: int,
    concurrency: int,
    seed: int = 0,
    vocab: int = 3000,
    on_half: Callable[[], Awaitable[tuple[float, int] | None]] | None = None,
    mix: dict[str, sc.Share] | None = None,
    limits: Limits | None = None,
    stall_hold_s: float = 3.0,
) -> SoakReport:
    """Send the mixed load; ``on_half`` (the replica kill) runs once a quarter of it has ended.
    ``limits``: the deployment's (the hog and its expected answer follow them)."""
    rng = random.Random(seed)
    plan = sc.plan(requests, rng, sc.DEFAULT_MIX if mix is None else mix)
    report = SoakReport([])
    t0 = time.monotonic()
    sem = asyncio.Semaphore(concurrency)
    conns = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)

    async with (
        httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=conns) as hc,
        AsyncClient(grpc_target, timeout=REQUEST_TIMEOUT_S) as gc,
    ):
        load = _Load(hc, gc, http_base, vocab, grpc_hostile(), limits or Limits(), stall_hold_s)

        async def one(kind: str, r: random.Random, ordinal: int) -> None:
            async with sem:
                start = time.monotonic() - t0
                name, result, detail = await load.send(kind, r, ordinal)
                report.outcomes.append(Outcome(kind, name, result, detail, start, time.monotonic() - t0))

        tasks = []
        ordinals: collections.Counter[str] = collections.Counter()
        for i, kind in enumerate(plan):
            tasks.append(asyncio.create_task(one(kind, random.Random(rng.random()), ordinals[kind])))
            ordinals[kind] += 1
            if i == requests // 2 and on_half is not None:
                # Let the first half get going, then kill.
                while len(report.outcomes) < requests // 4:
                    await asyncio.sleep(0.05)
                killed = await on_half()
                if killed is not None:
                    report.kill_time, report.killed_in_flight = killed[0] - t0, killed[1]
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
    report.seconds = time.monotonic() - t0
    return report


# -- the local deployment and the kill ------------------------------------------------------


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def worker_infos(app: str, samples: int = 24) -> dict[str, dict[str, Any]]:
    """Every worker replica's info, reached through the router (sampled until both are seen)."""
    from ray import serve

    h = serve.get_deployment_handle(WORKER_DEPLOYMENT, app_name=app)
    infos: dict[str, dict[str, Any]] = {}
    for _ in range(samples):
        try:
            info = h.info.remote().result(timeout_s=10)
        except Exception:  # noqa: BLE001 - a replica dying while sampled
            continue
        infos[info["replica_id"]] = info
    return infos


def kill_one_replica(app: str) -> tuple[float, int] | None:
    """SIGKILL one worker replica's process (a real crash); returns (when, its running+waiting)."""
    infos = worker_infos(app)
    if len(infos) < 2:
        return None
    victim = sorted(infos.values(), key=lambda i: i["replica_id"])[0]
    in_flight = int(victim.get("num_running", 0)) + int(victim.get("num_waiting", 0))
    os.kill(victim["pid"], signal.SIGKILL)
    return time.monotonic(), in_flight


def wait_batches_empty(app: str, timeout_s: float = 30.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    left: dict[str, int] = {}
    while time.monotonic() < deadline:
        left = {
            rid: int(i.get("num_running", 0)) + int(i.get("num_waiting", 0)) for rid, i in worker_infos(app, 8).items()
        }
        if left and not any(left.values()):
            return left
        time.sleep(0.5)
    return left


def replica_pids(app: str, deployment: str) -> set[int]:
    """The local processes of one deployment's replicas, by their Ray process title."""
    title = f"ServeReplica:{app}:{deployment}".encode()
    pids = set()
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                head = f.read(256)
        except OSError:
            continue
        if head.startswith(b"ray::" + title) and head[5 + len(title) : 6 + len(title)] in (b"", b"\0", b".", b" "):
            pids.add(int(path.split("/")[2]))
    return pids


async def soak_deployment(
    http_base: str,
    grpc_target: str,
    app: str,
    *,
    requests: int,
    concurrency: int,
    seed: int = 0,
    kill: bool = True,
    warmup: int = 64,
    limits: Limits | None = None,
    stall_hold_s: float = 3.0,
) -> SoakReport:
    """Warm up, record the replicas' RSS, run the soak (killing one replica halfway), check the end."""
    kw: dict[str, Any] = {"concurrency": concurrency, "limits": limits, "stall_hold_s": stall_hold_s}
    await run_soak(http_base, grpc_target, requests=warmup, seed=seed + 1, mix=sc.WARMUP_MIX, **kw)
    infos = await asyncio.to_thread(worker_infos, app)
    roles = {i["pid"]: "worker" for i in infos.values()}
    roles.update((pid, "ingress") for pid in replica_pids(app, INGRESS_DEPLOYMENT))
    rss_warm = {pid: rss_bytes(pid) for pid in roles}

    async def on_half() -> tuple[float, int] | None:
        return await asyncio.to_thread(kill_one_replica, app) if kill else None

    report = await run_soak(http_base, grpc_target, requests=requests, seed=seed, on_half=on_half, **kw)
    report.leftover = await asyncio.to_thread(wait_batches_empty, app)
    end = await asyncio.to_thread(worker_infos, app)
    alive = {i["pid"] for i in end.values()} | {pid for pid, role in roles.items() if role == "ingress"}
    report.rss_warm = {pid: b for pid, b in rss_warm.items() if b and pid in alive}
    report.rss_end = {pid: b for pid in report.rss_warm if (b := rss_bytes(pid))}
    report.roles = roles
    report.died = [pid for pid, role in roles.items() if role == "worker" and rss_bytes(pid) is None]
    return report


def soak_config(
    model: str, http_port: int, grpc_port: int, app: str = "logitpool", max_num_seqs: int = 32
) -> LogitpoolConfig:
    return LogitpoolConfig.model_validate(
        {
            "engine": {
                "model": model,
                "max_num_seqs": max_num_seqs,
                "max_model_len": 512,
                "logits_processors": [FAULT_FQCN],
            },
            "workers": {"num_replicas": 2, "num_cpus": 1},
            "server": {"http_port": http_port, "grpc_port": grpc_port},
            "app_name": app,
        }
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="logitpool bench soak")
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-kill", action="store_true", help="do not kill a worker replica halfway")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=9000)
    p.add_argument(
        "--stall-hold-s",
        type=float,
        default=10.0,
        help="how long a non-reading stream's client holds it unread before closing",
    )
    p.add_argument("--outcomes", help="write every request's outcome to this file (JSON lines)")
    args = p.parse_args(argv)
    from cluster.cli.launch import start_serve, wait_ready
    from worker.model.loader import embedded_model_path

    cfg = soak_config(str(embedded_model_path()), args.http_port, args.grpc_port)
    cfg = start_serve(cfg)
    wait_ready("127.0.0.1", cfg.server.http_port, 300.0)
    report = asyncio.run(
        soak_deployment(
            f"http://127.0.0.1:{cfg.server.http_port}",
            f"127.0.0.1:{cfg.server.grpc_port}",
            cfg.app_name,
            requests=args.requests,
            concurrency=args.concurrency,
            seed=args.seed,
            kill=not args.no_kill,
            limits=cfg.limits,
            stall_hold_s=args.stall_hold_s,
        )
    )
    print(report.render())
    if args.outcomes:
        with open(args.outcomes, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(asdict(o)) + "\n" for o in report.outcomes)
    bad = report.violations()
    for line in bad[:50]:
        print("VIOLATION", line)
    print("soak:", "FAILED" if bad else "passed")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
