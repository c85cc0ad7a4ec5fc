"""A throwaway sshd on 127.0.0.1 that `ray up` (local provider) can treat as a remote machine.

The sshd and everything started through it (Ray's head) run in their own PID and mount
namespaces: `ray stop`, which `ray up`/`ray down` run on the node and which kills every Ray
process it can see, then cannot reach the test session's own Ray cluster or anything else on
this machine; `/tmp/ray` is a private directory there. The launcher reaches the sshd through
`ProxyCommand` (this file, run as a script, relays stdin/stdout to the port): Ray's launcher has
no SSH port option. Sessions get their own HOME, whose login files put this interpreter's bin
directory on PATH, so `ray` resolves in the login shells Ray runs commands in.

Standard library only: this file is also executed as the ProxyCommand.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"
# What counts as a Ray process (ray's own `ray stop` list, abridged).
RAY_MARKERS = (
    "raylet",
    "gcs_server",
    "ray::",
    "default_worker.py",
    "dashboard",
    "monitor.py",
    "log_monitor.py",
    "ray_client_server",
    "runtime_env",
    "ray_process_reaper",
    "serve",
)


def privilege_prefix() -> list[str] | None:
    """[] as root, ["sudo", "-n"] where passwordless sudo works, else None."""
    if os.geteuid() == 0:
        return []
    if (
        shutil.which("sudo")
        and subprocess.run(["sudo", "-n", "true"], capture_output=True, check=False).returncode == 0
    ):
        return ["sudo", "-n"]
    return None


def ensure_packages() -> str | None:
    """Install openssh-server and rsync from Debian's packages if missing.

    Returns None when ready, else why it cannot be (the caller skips with that reason).
    """
    missing = [
        pkg for pkg, binary in (("openssh-server", SSHD), ("rsync", "/usr/bin/rsync")) if not Path(binary).exists()
    ]
    if not missing:
        return None
    prefix = privilege_prefix()
    if prefix is None or not shutil.which("apt-get"):
        return f"{', '.join(missing)} missing and cannot be installed here (needs apt-get as root or sudo -n)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]):
        done = subprocess.run([*prefix, *cmd], capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            return f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()[-300:]}"
    return None


def namespaces_available() -> str | None:
    """None if new PID + mount namespaces can be made here, else why not."""
    prefix = privilege_prefix()
    if prefix is None or not shutil.which("unshare"):
        return "cannot create PID/mount namespaces (needs unshare as root or sudo -n)"
    probe = [*prefix, "unshare", "--pid", "--fork", "--mount-proc", "true"]
    done = subprocess.run(probe, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return f"unshare --pid --mount-proc failed: {done.stderr.strip()[-200:]}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LoopbackSSHD:
    """A running namespaced sshd; `stop()` kills it and everything started through it."""

    port: int
    user: str
    key: Path
    home: Path
    ray_tmp: Path
    log: Path
    process: subprocess.Popen[bytes]
    namespace: str

    @property
    def proxy_command(self) -> str:
        return f"{sys.executable} {Path(__file__).resolve()} relay 127.0.0.1 {self.port}"

    def processes(self) -> list[tuple[int, str]]:
        """(pid, command line) of live (non-zombie) processes inside the namespace."""
        prefix = privilege_prefix()
        if not prefix:  # root reads every process's namespace link itself
            return processes_in(self.namespace)
        listed = subprocess.run(
            [*prefix, sys.executable, str(Path(__file__).resolve()), "list", self.namespace],
            capture_output=True,
            text=True,
            check=True,
        )
        return [(pid, cmd) for pid, cmd in json.loads(listed.stdout)]

    def ray_processes(self) -> list[tuple[int, str]]:
        return [(pid, cmd) for pid, cmd in self.processes() if any(m in cmd for m in RAY_MARKERS)]

    def stop(self) -> None:
        if self.process.poll() is None:
            # unshare --kill-child: its death SIGKILLs the namespace's init, and with it every
            # process in the namespace.
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        deadline = time.monotonic() + 10
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.1)


def start(workdir: Path, *, path_dirs: list[str], env: dict[str, str]) -> LoopbackSSHD:
    """Start the sshd. `path_dirs` go first on the sessions' PATH; `env` is exported in them."""
    prefix = privilege_prefix()
    assert prefix is not None, "call namespaces_available() first"
    workdir.mkdir(parents=True, exist_ok=True)
    home, ray_tmp = workdir / "home", workdir / "ray_tmp"
    for d in (home, ray_tmp):
        d.mkdir(exist_ok=True)
    user = "root"
    key, host_key = workdir / "id_ed25519", workdir / "host_ed25519"
    for k in (key, host_key):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(k)], check=True)
    pub = (workdir / "id_ed25519.pub").read_text().strip()
    (workdir / "authorized_keys").write_text(f'environment="HOME={home}" {pub}\n')
    exports = [f'export PATH="{":".join(path_dirs)}:$PATH"'] + [f'export {k}="{v}"' for k, v in env.items()]
    for name in (".profile", ".bashrc"):
        (home / name).write_text("\n".join(exports) + "\n")
    port = free_port()
    config = workdir / "sshd_config"
    config.write_text(
        "\n".join(
            [
                f"ListenAddress 127.0.0.1:{port}",
                f"HostKey {host_key}",
                f"PidFile {workdir / 'sshd.pid'}",
                f"AuthorizedKeysFile {workdir / 'authorized_keys'}",
                f"AllowUsers {user}",
                "PermitRootLogin prohibit-password",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",
                "PermitUserEnvironment yes",
                "MaxSessions 64",
                "MaxStartups 64",
                "Subsystem sftp internal-sftp",
                "LogLevel VERBOSE",
            ]
        )
        + "\n"
    )
    subprocess.run([*prefix, "mkdir", "-p", "/run/sshd", "/tmp/ray"], check=True)
    subprocess.run([*prefix, SSHD, "-t", "-f", str(config)], check=True)
    log = workdir / "sshd.log"
    inner = 'mount --bind "$1" /tmp/ray && exec "$2" -D -E "$3" -f "$4"'
    unshare = ["unshare", "--pid", "--mount", "--mount-proc", "--propagation", "private", "--kill-child"]
    argv = [*prefix, *unshare, "sh", "-c", inner, "sh", str(ray_tmp), SSHD, str(log), str(config)]
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    namespace = _wait_for_namespace(process.pid)
    sshd = LoopbackSSHD(port, user, key, home, ray_tmp, log, process, namespace)
    _wait_for_port(port, process)
    return sshd


def _wait_for_namespace(pid: int) -> str:
    """The PID namespace unshare made for its child (pid_for_children of unshare itself)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            ns = os.readlink(f"/proc/{pid}/ns/pid_for_children")
            if ns != os.readlink("/proc/self/ns/pid"):
                return ns
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("unshare did not create a PID namespace")
        time.sleep(0.05)


def _wait_for_port(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 15
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"sshd exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                if s.recv(4).startswith(b"SSH-"):
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"sshd is not answering on 127.0.0.1:{port}")
        time.sleep(0.1)


def processes_in(namespace: str) -> list[tuple[int, str]]:
    """Live processes whose PID namespace is `namespace` (zombies are not running, skip them)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "ns" / "pid") != namespace:
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if state != "Z":
            found.append((int(entry.name), cmdline))
    return found


def relay(host: str, port: int) -> None:
    """ProxyCommand body: copy stdin to the socket and the socket to stdout until both close."""
    sock = socket.create_connection((host, port))

    def upstream() -> None:
        while data := os.read(0, 65536):
            sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)

    threading.Thread(target=upstream, daemon=True).start()
    out = sys.stdout.buffer
    while data := sock.recv(65536):
        out.write(data)
        out.flush()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "relay":
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        relay(sys.argv[2], int(sys.argv[3]))
    elif len(sys.argv) == 3 and sys.argv[1] == "list":
        print(json.dumps(processes_in(sys.argv[2])))
    else:
        sys.exit(f"usage: {sys.argv[0]} relay HOST PORT | list NAMESPACE")
