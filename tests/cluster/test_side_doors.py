"""`logitpool serve` for real (a subprocess starting its own local Ray cluster — the one test
that cannot use the session's cluster, since what it checks is how the CLI starts one): every
listening socket of its whole process tree is on the chosen host (loopback), except the gRPC
port, which Ray Serve 2.60's proxy binds on every interface; Ray token auth is on (RAY_AUTH_MODE
is removed from the child's environment, which the test suite otherwise sets to `disabled`).
With several API keys in LOGITPOOL_API_KEY, the banner's curl example works as printed; Serve's
gRPC proxy refuses a message past limits.max_grpc_message_bytes before anything reads it; the
HTTP proxy answers 431 past the config's `limits.max_header_bytes` (the CLI passes it on)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from client import Client
from tests.conftest import REPO_ROOT, free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow]

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        todo.extend(children.get(p, ()))
    return out


def _ip(hex_addr: str) -> str:
    """An address of /proc/net/tcp{,6} ("0100007F" or 32 hex digits, little-endian words)."""
    import ipaddress

    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return f"::ffff:{ip.ipv4_mapped}"
    return str(ip)


def listening_sockets(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, ip, port) of every TCP socket in LISTEN state owned by one of `pids`."""
    listen: dict[str, tuple[str, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A":  # TCP_LISTEN
                addr, port = cols[1].split(":")
                listen[cols[9]] = (_ip(addr), int(port, 16))
    out = []
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in listen:
                out.append((pid, *listen[target[8:-1]]))
    return out


def _banner_curl_works(lines: list[str], env: dict[str, str]) -> None:
    """The banner's curl line, run by a POSIX shell as printed, with several keys in the variable."""
    (curl,) = [line for line in lines if line.strip().startswith("curl ")]
    out = subprocess.run(
        ["sh", "-c", curl.strip() + " --silent --show-error --max-time 60 --write-out ' %{http_code}'"],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert out.stdout.endswith(" 200"), (curl, out.stdout[-500:], out.stderr[-500:])


def _grpc_message_bound(grpc_port: int) -> None:
    """Past limits.max_grpc_message_bytes (4 MiB): Serve's proxy refuses it, key or not, without
    reading it; past limits.max_body_bytes (1 MiB) only: the ingress refuses it, naming the limit."""
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=[("grpc.max_send_message_length", -1)]) as ch:
        rpc = ch.unary_unary("/logitpool.v1.LogitPool/Generate", request_serializer=None, response_deserializer=None)
        for size, key, code, says in [
            (5 << 20, None, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
            (5 << 20, "k1", grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
            (2 << 20, "k1", grpc.StatusCode.INVALID_ARGUMENT, "limits.max_body_bytes"),
            (2 << 20, None, grpc.StatusCode.UNAUTHENTICATED, "API key"),
        ]:
            meta = (("authorization", f"Bearer {key}"),) if key else ()
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                rpc(b"\x0a" + b"\xff" * size, timeout=60, metadata=meta)
            assert err.value.code() == code and says in err.value.details(), err.value.details()
            print(f"gRPC {size >> 20} MiB, key={key}: {code.name} in {time.monotonic() - start:.2f}s")


def _metrics_export_on_loopback(pids: set[int], sockets: list[tuple[int, str, int]]) -> None:
    """Ray's dashboard agent exports Prometheus metrics without the Ray token, on loopback only
    (Ray 2.60 has no switch for it: README, "Side doors"). Found by asking each agent listener."""
    agents = {pid for pid in pids if b"ray::DashboardAgent" in Path(f"/proc/{pid}/cmdline").read_bytes()}
    exporters = []
    for pid, ip, port in sockets:
        if pid in agents:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
            except httpx.HTTPError:
                continue
            if r.status_code == 200 and "ray_" in r.text:
                exporters.append((ip, port, len(r.content)))
    assert exporters and all(ip in LOOPBACK for ip, _, _ in exporters), (exporters, agents)
    print(f"Ray agent metrics without the token (loopback): {exporters}")


def _head_status(port: int, size: int) -> bytes:
    """The status line Serve's HTTP proxy answers a GET /health whose head is `size` bytes."""
    import socket

    start = "GET /health HTTP/1.1\r\nhost: t\r\nx-pad: "
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall((start + "a" * (size - len(start) - 4) + "\r\n\r\n").encode())
        return s.recv(65536).split(b"\r\n", 1)[0]


def test_logitpool_serve_listens_only_on_the_chosen_host(tiny_model_dir, tmp_path):
    http_port, grpc_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "LOGITPOOL_HTTP"))}
    env["PYTHONPATH"] = str(REPO_ROOT)
    env["LOGITPOOL_API_KEY"] = "k1,k2"
    config = tmp_path / "config.yaml"  # a header limit of its own: the CLI hands it to Serve's proxy
    config.write_text("limits:\n  max_header_bytes: 8192\n")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cluster.cli",
            "serve",
            "--model",
            str(tiny_model_dir),
            "--host",
            "127.0.0.1",
            "--http-port",
            str(http_port),
            "--grpc-port",
            str(grpc_port),
            "--config",
            str(config),
        ],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        lines = []
        while time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
            lines.append(line)
            if "Ctrl-C to stop" in line:
                break
        assert proc.poll() is None, "".join(lines)[-3000:]
        assert f"[::]:{grpc_port}" in "".join(lines), "the banner must say gRPC listens on every interface"
        _banner_curl_works(lines, env)
        r = httpx.post(
            f"http://127.0.0.1:{http_port}/v1/completions",
            json={"prompt": "x", "max_tokens": 2},
            headers={"Authorization": "bearer k2"},
        )
        assert r.status_code == 200
        assert _head_status(http_port, 8000) == b"HTTP/1.1 200 OK"
        assert _head_status(http_port, 9000) == b"HTTP/1.1 431 Request Header Fields Too Large"
        with Client(f"127.0.0.1:{grpc_port}", api_key="k1", timeout=60) as c:
            assert c.health() and len(c.generate("x", max_tokens=2, ignore_eos=True).token_ids) == 2
        _grpc_message_bound(grpc_port)
        sockets = listening_sockets(_descendants(proc.pid))
        _metrics_export_on_loopback(_descendants(proc.pid), sockets)
        assert any(port == http_port for _, _, port in sockets)
        exposed = [(pid, ip, port) for pid, ip, port in sockets if ip not in LOOPBACK]
        assert {port for _, _, port in exposed} <= {grpc_port}, f"listening beyond loopback: {exposed}"
        gcs_env = [
            dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
            for pid in _descendants(proc.pid)
            if b"gcs_server" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        assert len(gcs_env) == 1 and gcs_env[0][b"RAY_AUTH_MODE"] == b"token"
        token = Path(gcs_env[0][b"RAY_AUTH_TOKEN_PATH"].decode())
        assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text()) == 64
        assert token.parent.stat().st_mode & 0o777 == 0o700
        print(f"listening: {len(sockets)} sockets, beyond loopback: {exposed}")
    finally:
        started = _descendants(proc.pid) - {proc.pid}
        proc.send_signal(signal.SIGINT)  # the CLI shuts Serve and its Ray cluster down
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        for pid in started:  # whatever this test's CLI started and left behind
            try:
                if b"ray" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    assert proc.returncode == 0
