"""A real S3-compatible object store on 127.0.0.1: Debian's radosgw on a one-node Ceph.

    python -m runtime.radosgw [--dir DIR]     start it, print the S3 settings, stop on Ctrl-C

Used by the object-store checkpoint test and `benchmarks/checkpoint_bench.py`. The cluster is
one monitor, one OSD whose object store is ``memstore`` (objects in the OSD's memory: nothing
on disk, gone at teardown) and one radosgw with the beast HTTP frontend; authentication inside
the cluster is off (``auth_*_required = none``: only this machine's 127.0.0.1 can reach it),
S3 requests are signed with the key of a user that ``radosgw-admin`` creates. Pools are made
with 8 placement groups and one replica (one OSD holds everything). Every daemon runs in the
foreground as a child of this process (``-f``), in its own process group, so `stop` ends all of
them and leaves no orphan (and each gets SIGTERM if the starting process dies without
calling it); a failed start stops what it had started and raises with the last
lines of the daemon logs.

Needs the ``ceph-mon``, ``ceph-osd``, ``radosgw`` and ``ceph-common`` packages (Debian
bookworm: Ceph 16.2 "Pacific"); `missing_binaries` says which are absent.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool", "ceph")
#: S3 credentials of the user created in every fresh cluster (the cluster lives only as long
#: as the test that started it, on 127.0.0.1).
ACCESS_KEY = "meshplan-test-access"
SECRET_KEY = "meshplan-test-secret"


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies, however it
    dies (Linux ``PR_SET_PDEATHSIG``), so a killed test leaves no daemon behind."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)                  # PR_SET_PDEATHSIG = 1


def missing_binaries() -> list[str]:
    """The Ceph programs `Radosgw.start` needs that are not on PATH."""
    return [b for b in BINARIES if shutil.which(b) is None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Radosgw:
    """One-node Ceph + radosgw in ``root`` (see the module docstring).

    After `start`: ``endpoint_url`` (``http://127.0.0.1:PORT``), `ACCESS_KEY`, `SECRET_KEY`;
    ``storage_options`` are the s3fs arguments; ``env`` the matching AWS_* variables (what a
    torchrun worker reads, `runtime.checkpoint`).
    """

    root: Path
    mon_port: int = field(default_factory=free_port)
    rgw_port: int = field(default_factory=free_port)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    startup_s: float | None = None

    @property
    def conf(self) -> Path:
        return self.root / "ceph.conf"

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.rgw_port}"

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint_url, "AWS_DEFAULT_REGION": "us-east-1"}

    @property
    def storage_options(self) -> dict:
        return {"key": ACCESS_KEY, "secret": SECRET_KEY,
                "client_kwargs": {"endpoint_url": self.endpoint_url}}

    # -- bring-up -----------------------------------------------------------------------------
    def start(self, timeout_s: float = 120.0) -> Radosgw:
        """Create and start the cluster; return when radosgw answers S3 requests.

        Raises:
            RuntimeError: a binary is missing, or a daemon did not come up within
                ``timeout_s`` (the message holds the end of its log); everything started is
                stopped first.
        """
        if missing := missing_binaries():
            raise RuntimeError(f"Ceph programs not found: {', '.join(missing)} (Debian: "
                               "apt-get install ceph-mon ceph-osd radosgw ceph-common)")
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        try:
            self._write_conf()
            self._start_mon(deadline)
            self._start_osd(deadline)
            self._start_rgw(deadline)
            self._create_user()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _write_conf(self) -> None:
        for sub in ("mon/ceph-a", "osd/ceph-0", "run", "log", "rgw"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        r = self.root
        self.fsid = str(uuid.uuid4())
        self.conf.write_text(f"""[global]
fsid = {self.fsid}
mon host = [v1:127.0.0.1:{self.mon_port}]
ms bind msgr2 = false
ms bind ipv4 = true
ms bind ipv6 = false
public addr = 127.0.0.1
cluster addr = 127.0.0.1
public network = 127.0.0.0/8
auth cluster required = none
auth service required = none
auth client required = none
run dir = {r}/run
admin socket = {r}/run/$name.asok
log file = {r}/log/$name.log
pid file = {r}/run/$name.pid
mon data = {r}/mon/$cluster-$id
osd data = {r}/osd/$cluster-$id
osd objectstore = memstore
memstore device bytes = {2 << 30}
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon max pg per osd = 1000
osd op num shards = 1
osd crush update on start = false
osd class update on start = false
osd op num threads per shard = 1
[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:{self.rgw_port} tcp_nodelay=1
rgw data = {r}/rgw
rgw dns name = 127.0.0.1
rgw thread pool size = 16
""")

    def _ceph(self, *args: str, timeout_s: float = 30.0) -> str:
        out = subprocess.run(["ceph", "-c", str(self.conf), "--connect-timeout", "10", *args],
                             capture_output=True, text=True, timeout=timeout_s)
        if out.returncode != 0:
            raise RuntimeError(f"ceph {' '.join(args)} failed ({out.returncode}): "
                               f"{out.stderr.strip()[-800:]}")
        return out.stdout

    def _daemon(self, name: str, cmd: list[str]) -> None:
        log = (self.root / "log" / f"{name}.stdout").open("w")
        self.procs[name] = subprocess.Popen(cmd + ["-f", "-c", str(self.conf)], stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True,
                                            preexec_fn=_die_with_parent)

    def _start_mon(self, deadline: float) -> None:
        monmap = self.root / "monmap"
        subprocess.run(["monmaptool", "--create", "--fsid", self.fsid, "--addv", "a",
                        f"[v1:127.0.0.1:{self.mon_port}]", str(monmap)], check=True,
                       capture_output=True)
        subprocess.run(["ceph-mon", "-c", str(self.conf), "--mkfs", "-i", "a",
                        "--monmap", str(monmap)], check=True, capture_output=True)
        self._daemon("mon.a", ["ceph-mon", "-i", "a"])
        self._wait(deadline, "mon.a", lambda: self._ceph("mon", "stat", timeout_s=15))

    def _start_osd(self, deadline: float) -> None:
        osd_uuid = str(uuid.uuid4())
        # a monitor that answers `mon stat` may still refuse commands for a moment ("EPERM:
        # problem getting command descriptions"); `osd new` of one uuid is idempotent
        answer: list[str] = []
        self._wait(deadline, "mon.a", lambda: answer.append(self._ceph("osd", "new", osd_uuid)))
        osd_id = answer[-1].strip()
        # placed in the CRUSH map here, not by the OSD at start: its own "crush
        # create-or-move" can reach the monitor before it knows the fsid, which the monitor
        # refuses, and the OSD then exits with status 1 (seen with Ceph 16.2.15)
        self._ceph("osd", "crush", "add", f"osd.{osd_id}", "1.0", "root=default")
        subprocess.run(["ceph-osd", "-c", str(self.conf), "-i", osd_id, "--mkfs",
                        "--osd-uuid", osd_uuid], check=True, capture_output=True)
        self._daemon(f"osd.{osd_id}", ["ceph-osd", "-i", osd_id])

        def osd_up():
            stat = json.loads(self._ceph("osd", "stat", "--format", "json"))
            stat = stat.get("osdmap", stat)
            if stat["num_up_osds"] < 1 or stat["num_in_osds"] < 1:
                raise RuntimeError(f"osd not up yet: {stat}")
        self._wait(deadline, f"osd.{osd_id}", osd_up)

    def _start_rgw(self, deadline: float) -> None:
        self._daemon("client.rgw", ["radosgw", "-n", "client.rgw"])

        def answers():
            try:
                urllib.request.urlopen(self.endpoint_url, timeout=2).read()
            except urllib.error.HTTPError:
                return                       # any S3 answer (403 for anonymous) means up
        self._wait(deadline, "client.rgw", answers)

    def _create_user(self) -> None:
        out = subprocess.run(["radosgw-admin", "-c", str(self.conf), "-n", "client.rgw",
                              "user", "create", "--uid", "meshplan", "--display-name",
                              "meshplan", "--access-key", ACCESS_KEY, "--secret-key",
                              SECRET_KEY], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"radosgw-admin user create failed: {out.stderr[-800:]}")

    def _wait(self, deadline: float, name: str, probe) -> None:
        """Poll ``probe`` (raises while not ready) until it passes, the daemon exits, or the
        deadline passes (then raise with the end of the daemon's log)."""
        last = None
        while time.monotonic() < deadline:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}: {self._log(name)}")
            try:
                probe()
                return
            except Exception as exc:                 # not ready yet
                last = exc
            time.sleep(0.3)
        raise RuntimeError(f"{name} not ready in time ({last}): {self._log(name)}")

    def _log(self, name: str, lines: int = 15) -> str:
        text = ""
        for path in (self.root / "log" / f"{name}.log", self.root / "log" / f"{name}.stdout"):
            if path.is_file():
                text += "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return text or "(no log)"

    # -- teardown -----------------------------------------------------------------------------
    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop every daemon, newest first (radosgw, the OSD, then the monitor, which the
        OSD tells that it goes down: with the monitor gone first it waits 5 s for it):
        SIGTERM to its process group, SIGKILL after ``timeout_s``."""
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        self.procs.clear()

    def __enter__(self) -> Radosgw:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="state folder (default: a temporary one)")
    args = parser.parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="radosgw_"))
    # SIGTERM stops the daemons as Ctrl-C does (the default action would skip the cleanup)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with Radosgw(root) as gw:
        print(f"radosgw up in {gw.startup_s:.1f} s at {gw.endpoint_url} (state in {root})")
        for k, v in gw.env.items():
            print(f"export {k}={v}")
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
