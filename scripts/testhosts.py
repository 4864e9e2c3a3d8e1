#!/usr/bin/env python3
"""Test hosts on one machine: 2 or 3 network namespaces on a private test subnet, torn down afterwards.

Each "host" is a network namespace with one interface (named as you like, so tests can give hosts
different interface names) holding an address from a private test subnet (default 10.213.0.0/24). The
hosts are joined through a bridge that lives in a namespace of its own, so nothing is added to the
machine's own network namespace and the test subnet exists only inside the namespaces. Optionally each
host's interface is limited with ``tc qdisc ... tbf`` (netem is not available here), which limits both
directions of every host-to-host path.

As a command (root only)::

    scripts/testhosts.py [--hosts 2] [--rate 200mbit] [--ifnames eth0,ens5] -- COMMAND ...

runs COMMAND with ``DTRAIN_TESTHOSTS`` = ``ns=ifname=address`` entries (comma separated) and
``DTRAIN_TESTHOSTS_EXEC_<i>`` = ``ip netns exec <ns>``, and tears everything down when COMMAND exits,
fails or is interrupted. ``scripts/testhosts.py cleanup`` deletes namespaces left by a killed run.

As a module: ``with TestHosts(2, rate="200mbit") as hosts: hosts.popen(0, [...])``.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PREFIX = "dtrain-th-"  # every namespace this script creates starts with it (cleanup relies on it)
DEFAULT_SUBNET = "10.213.0.0/24"
NETNS_ETC = Path("/etc/netns")  # per-namespace /etc overrides used by `ip netns exec`


def unavailable_reason() -> str | None:
    """Why namespaces cannot be created here (None when they can): the skip reason for tests."""
    if os.geteuid() != 0:
        return "network namespaces need root (os.geteuid() != 0)"
    if shutil.which("ip") is None:
        return "iproute2 'ip' is not installed"
    probe = f"{PREFIX}probe-{uuid.uuid4().hex[:6]}"
    try:
        subprocess.run(["ip", "netns", "add", probe], check=True, capture_output=True, timeout=10)
    except (subprocess.SubprocessError, OSError) as exc:
        return f"'ip netns add' does not work here: {getattr(exc, 'stderr', b'') or exc}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


@dataclass(frozen=True)
class Host:
    netns: str
    ifname: str
    address: str  # without prefix
    prefixlen: int

    @property
    def cidr(self) -> str:
        return f"{self.address}/{self.prefixlen}"

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]


class TestHosts:
    """Create ``n`` namespaced hosts on ``subnet``; ``rate`` (e.g. "200mbit") limits each host's link."""

    __test__ = False  # not a pytest class

    def __init__(self, n: int = 2, subnet: str = DEFAULT_SUBNET, ifnames: Sequence[str] | None = None,
                 rate: str | None = None, extra_veth: dict[int, tuple[str, str]] | None = None,
                 pin_cpus: bool = False) -> None:
        if not 2 <= n <= 3:
            raise ValueError(f"2 or 3 hosts, got {n}")
        net = ipaddress.ip_network(subnet)
        if not net.is_private:
            raise ValueError(f"{subnet} is not a private subnet")
        names = list(ifnames) if ifnames else ["eth0"] * n
        if len(names) != n:
            raise ValueError(f"{n} hosts need {n} interface names, got {names}")
        tag = f"{PREFIX}{os.getpid() % 100000}-{uuid.uuid4().hex[:4]}"
        hosts_ips = list(net.hosts())
        self.switch = f"{tag}-sw"
        self.hosts = [Host(f"{tag}-h{i}", names[i], str(hosts_ips[i]), net.prefixlen) for i in range(n)]
        self.rate = rate
        # Per host: a second interface (name, cidr) on a dangling veth: reaches nothing (for tests).
        self.extra_veth = extra_veth or {}
        self._procs: list[subprocess.Popen] = []
        # Pinning host i to CPU i (round robin) gives each host cores of its own, as separate machines
        # have; unpinned, every host sizes its thread pools for the whole machine and they fight.
        cpus = sorted(os.sched_getaffinity(0))
        self.cpus = [cpus[i % len(cpus)] for i in range(n)] if pin_cpus else None

    # ----------------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> TestHosts:
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def create(self) -> None:
        # `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts: every host can then name the
        # others (h0, h1, ...) and reverse lookups of test addresses answer at once instead of asking a
        # DNS server that is unreachable from inside the namespace.
        # (torch's store serves IPv6 sockets: peers show up as IPv4-mapped addresses, listed too.)
        self._made_etc = not NETNS_ETC.exists()  # remove it again on teardown if it was ours
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{h.address} {self.hostname(i)}\n::ffff:{h.address} "
                                                       f"{self.hostname(i)}\n" for i, h in enumerate(self.hosts))
        for ns in [h.netns for h in self.hosts] + [self.switch]:
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / ns / "hosts").write_text(hosts_file)
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            _ip("netns", "add", host.netns)
            _ip("-n", host.netns, "link", "set", "lo", "up")
            # Created inside the switch namespace, the host end moved straight into the host's: the
            # machine's own namespace never sees either end.
            _ip("-n", self.switch, "link", "add", f"p{i}", "type", "veth", "peer", "name", host.ifname,
                "netns", host.netns)
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{i}", "up")
            _ip("-n", host.netns, "addr", "add", host.cidr, "dev", host.ifname)
            _ip("-n", host.netns, "link", "set", host.ifname, "up")
            if self.rate:
                _run(["tc", "-n", host.netns, "qdisc", "add", "dev", host.ifname, "root", "tbf", "rate", self.rate,
                      "burst", "32kbit", "latency", "50ms"])
            if i in self.extra_veth:
                name, cidr = self.extra_veth[i]
                _ip("-n", host.netns, "link", "add", name, "type", "veth", "peer", "name", f"{name}p")
                _ip("-n", host.netns, "addr", "add", cidr, "dev", name)
                _ip("-n", host.netns, "link", "set", name, "up")
                _ip("-n", host.netns, "link", "set", f"{name}p", "up")

    def destroy(self) -> None:
        """Kill every process still inside our namespaces, then delete them (and with them every veth)."""
        for proc in self._procs:
            if proc.poll() is None:
                _kill_group(proc)
        for ns in [h.netns for h in self.hosts] + [self.switch]:
            for pid in _netns_pids(ns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        if getattr(self, "_made_etc", False):
            with contextlib.suppress(OSError):  # not empty: another run still uses it
                NETNS_ETC.rmdir()

    def hostname(self, i: int) -> str:
        """The name host ``i`` has inside the namespaces (from their /etc/hosts)."""
        return f"h{i}"

    # -------------------------------------------------------------------------------------- running
    def argv(self, i: int, argv: Sequence[str]) -> list[str]:
        pin = ["taskset", "-c", str(self.cpus[i])] if self.cpus is not None else []
        return [*self.hosts[i].exec_prefix(), *pin, *argv]

    def popen(self, i: int, argv: Sequence[str], **kwargs: object) -> subprocess.Popen:
        """Start ``argv`` on host ``i`` in its own process group (killed by :meth:`destroy`)."""
        proc = subprocess.Popen(self.argv(i, argv), start_new_session=True, **kwargs)  # type: ignore[call-overload]
        self._procs.append(proc)
        return proc

    def env_description(self) -> str:
        return ",".join(f"{h.netns}={h.ifname}={h.address}" for h in self.hosts)


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _netns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10)
    return [int(p) for p in out.stdout.split() if p.isdigit() and int(p) != os.getpid()]


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr.strip()}")


def cleanup() -> list[str]:
    """Delete namespaces left behind by a killed run of this script (only ours: by name prefix)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    removed = []
    for line in out.splitlines():
        ns = line.split()[0] if line.split() else ""
        if ns.startswith(PREFIX):
            for pid in _netns_pids(ns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            removed.append(ns)
    for leftover in NETNS_ETC.glob(f"{PREFIX}*") if NETNS_ETC.is_dir() else []:
        shutil.rmtree(leftover, ignore_errors=True)
    return removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=2, choices=[2, 3])
    parser.add_argument("--subnet", default=DEFAULT_SUBNET)
    parser.add_argument("--rate", help="tbf rate on every host link, e.g. 200mbit")
    parser.add_argument("--ifnames", help="comma-separated interface name per host (default eth0 everywhere)")
    parser.add_argument("--pin-cpus", action="store_true", help="DTRAIN_TESTHOSTS_EXEC_<i> pins host i to CPU i")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS, or 'cleanup'")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    reason = unavailable_reason()
    if reason:
        print(f"testhosts: {reason}", file=sys.stderr)
        return 2
    if command == ["cleanup"]:
        print("\n".join(cleanup()) or "nothing to clean up")
        return 0
    if not command:
        parser.error("give a command after --")
    # SIGTERM/SIGHUP must still run the teardown below.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    ifnames = args.ifnames.split(",") if args.ifnames else None
    with TestHosts(args.hosts, args.subnet, ifnames, args.rate, pin_cpus=args.pin_cpus) as hosts:
        env = {**os.environ, "DTRAIN_TESTHOSTS": hosts.env_description()}
        for i in range(len(hosts.hosts)):
            env[f"DTRAIN_TESTHOSTS_EXEC_{i}"] = " ".join(hosts.argv(i, []))
        start = time.monotonic()
        try:
            proc = subprocess.Popen(command, env=env, start_new_session=True)
            hosts._procs.append(proc)
            code = proc.wait()
        except KeyboardInterrupt:
            code = 130
        print(f"testhosts: command exited {code} after {time.monotonic() - start:.1f}s; tearing down",
              file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())

