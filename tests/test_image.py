"""The image, built for real from the Dockerfile and run the way the pod runs it.

The test makes the Dockerfile's base image itself, since no public registry can be reached from
the machines these tests run on: ``mmdebstrap`` installs Debian bookworm with ``python3``,
``python3-venv`` and ``passwd`` into a tarball, and ``buildah`` commits it under the exact name
of the Dockerfile's ``FROM`` (``docker.io/library/python:3.12-slim-bookworm``). It is a stand-in
(Debian's Python 3.11 at /usr/bin/python3, not python.org's 3.12 at /usr/local/bin): the
Dockerfile uses only what both have. The stand-in trusts the CAs this machine trusts (a copy of
its CA bundle, and ``PIP_CERT``), so that the build stage's ``pip install`` reaches PyPI through
whatever TLS-intercepting proxy this machine's own pip goes through; nothing of that is in the
Dockerfile.

Then ``buildah build --isolation chroot --pull=never`` builds the Dockerfile as it is, and:

- the image's entrypoint, run as the image's own user (65532, non-root) with
  ``--once --simulate healthy``, prints the same series as this checkout's agent and exits 0;
  ``probe --simulate healthy`` reports the simulated GPUs and exits 0;
- the image declares the volumes the manifests mount, and its user can write there and nowhere
  else of the image;
- the gpu-sidecar container of the example Deployment, as ``kubectl kustomize k8s/base`` renders
  it, on a read-only root filesystem (mount namespaces of the test's own: the image's root bound
  read-only, the pod's volumes bound from temporary directories owned as ``fsGroup`` makes
  them, the agent PID 1 of a PID namespace with no network), run with its own environment (the
  image's, then ``envFrom``, then ``env``): the entrypoint places the injected publisher, binds
  the socket, spools the batches its unreachable receiver never takes, the manifest's exec
  probes pass beside it, and at SIGTERM it exits 0;
- the build context is what ``.dockerignore`` lets in: the package and nothing else.

Every byte buildah stores is under the test's temporary directory (``--root``, ``--runroot``, its
own containers.conf, registries.conf and storage.conf, ``TMPDIR``), removed at the end; nothing is
pulled or pushed. Machine: root (buildah's chroot isolation and the mount namespaces need it),
``buildah`` and ``mmdebstrap`` (scripts/test installs both), ``kubectl``, util-linux
(``unshare``, ``nsenter``, ``mount``), Debian's mirror and PyPI. Without buildah or mmdebstrap,
or as another user, the test is skipped and says why."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, run_cli
from tests.receivers import need

DOCKERFILE = ROOT / "Dockerfile"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEBIAN_SUITE = "bookworm"  # the Dockerfile's base is python:3.12-slim-bookworm
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "passwd")
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
IMAGE = "localhost/gpu-sidecar:image-test"
SYSTEM_CONTAINERS = Path("/var/lib/containers")  # where root's buildah keeps a blob-info cache

MMDEBSTRAP_TIMEOUT_S = 600
BUILD_TIMEOUT_S = 900
RUN_TIMEOUT_S = 60

# The pod's view: a read-only root, a tmpfs /dev with the usual devices, /proc of the PID
# namespace, the manifest's volumes bound in, and the entrypoint exec'd as PID 1 under the
# image's user. Arguments: rootfs, mountpoint, user, then "DEST=SOURCE" for each volume, "--",
# and the command.
POD_SH = r'''
set -eu
rootfs=$1 new=$2 user=$3
shift 3
mount --bind "$rootfs" "$new"
mount -o remount,bind,ro,nosuid,nodev "$new"
mount -t proc -o nosuid,nodev,noexec proc "$new/proc"
mount -t tmpfs -o nosuid,mode=0755,size=1m tmpfs "$new/dev"
for d in null zero full random urandom tty; do
  touch "$new/dev/$d"
  mount --bind "/dev/$d" "$new/dev/$d"
done
while [ "$1" != "--" ]; do
  mount --bind "${1#*=}" "$new${1%%=*}"
  shift
done
shift
exec chroot --userspec="$user" "$new" "$@"
'''


def base_images(*, qualify: bool = True) -> list[str]:
    """The images the Dockerfile's FROM lines name, fully qualified as a registry would have
    them unless told otherwise (stage names and ``scratch`` left out)."""
    names: list[str] = []
    stages: set[str] = set()
    for m in re.finditer(r"^FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?", DOCKERFILE.read_text(),
                         re.M | re.I):
        name, stage = m.group(1), m.group(2)
        if name.lower() not in stages and name != "scratch" and name not in names:
            names.append(name)
        if stage:
            stages.add(stage.lower())
    return [qualified(n) for n in names] if qualify else names


def qualified(name: str) -> str:
    first, _, rest = name.partition("/")
    if not rest:
        return f"docker.io/library/{name}"
    if "." not in first and ":" not in first and first != "localhost":
        return f"docker.io/{name}"
    return name


def prometheus_series(text: str) -> list[tuple[str, dict[str, str]]]:
    """(name, labels) of every sample line of a text exposition."""
    series = []
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s", line)
        if m:
            series.append((m.group(1), dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))))
    return series


def missing_tools() -> str | None:
    if os.geteuid() != 0:
        return "needs root: buildah's chroot isolation and the read-only-root namespace mount"
    tools = ("buildah", "mmdebstrap", "unshare", "nsenter", "mount", "chroot")
    absent = [t for t in tools if not shutil.which(t)]
    if absent:
        return f"{', '.join(absent)} not installed (bash scripts/test installs buildah and mmdebstrap)"
    return None


@dataclass
class Buildah:
    """buildah with all of its state under ``top``."""

    top: Path

    def __post_init__(self) -> None:
        for d in ("root", "runroot", "tmp", "home", "conf"):
            (self.top / d).mkdir(parents=True, exist_ok=True)
        conf = self.top / "conf"
        (conf / "storage.conf").write_text(
            f'[storage]\ndriver = "vfs"\ngraphroot = "{self.top / "root"}"\n'
            f'runroot = "{self.top / "runroot"}"\n')
        # no search registries: a short name is looked up in this storage only
        (conf / "registries.conf").write_text('unqualified-search-registries = []\n'
                                              'short-name-mode = "permissive"\n')
        (conf / "containers.conf").write_text("[engine]\n")
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "HOME": str(self.top / "home"),
            "TMPDIR": str(self.top / "tmp"),
            "CONTAINERS_STORAGE_CONF": str(conf / "storage.conf"),
            "CONTAINERS_REGISTRIES_CONF": str(conf / "registries.conf"),
            "CONTAINERS_CONF": str(conf / "containers.conf"),
        }
        # a proxy this machine needs is needed by the build stage too (buildah passes these on)
        for k in ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"):
            if k in os.environ:
                self.env[k] = os.environ[k]

    def __call__(self, *args: str, timeout: float = RUN_TIMEOUT_S, check: bool = True
                 ) -> subprocess.CompletedProcess[str]:
        cmd = ["buildah", "--root", str(self.top / "root"), "--runroot", str(self.top / "runroot"),
               "--storage-driver", "vfs", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env,
                              stdin=subprocess.DEVNULL, cwd=self.top)
        if check:
            assert proc.returncode == 0, (
                f"{' '.join(cmd)} exited {proc.returncode}\n"
                f"stdout: {proc.stdout[-4000:]}\nstderr: {proc.stderr[-4000:]}")
        return proc

    def run(self, ctr: str, *command: str, timeout: float = RUN_TIMEOUT_S
            ) -> subprocess.CompletedProcess[str]:
        """``command`` in the working container ``ctr``, as the image's user."""
        return self("run", "--isolation", "chroot", ctr, "--", *command, timeout=timeout,
                    check=False)

    def clean(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError, AssertionError):
            self("rm", "--all", check=False)
            self("rmi", "--all", "--force", check=False)
        shutil.rmtree(self.top, ignore_errors=True)


@dataclass
class Image:
    buildah: Buildah
    name: str
    config: dict  # the OCI image config: User, Env, Entrypoint, Volumes, ...

    @property
    def entrypoint(self) -> list[str]:
        return list(self.config.get("Entrypoint") or [])

    @property
    def user(self) -> str:
        return self.config.get("User") or "0:0"

    def container(self) -> str:
        return self.buildah("from", "--pull=never", "--quiet", self.name).stdout.strip()


def make_base(buildah: Buildah, names: list[str]) -> None:
    tarball = buildah.top / "tmp" / "base.tar"
    proc = subprocess.run(
        ["mmdebstrap", "--quiet", "--variant=apt", "--mode=root",
         f"--include={','.join(BASE_PACKAGES)}", DEBIAN_SUITE, str(tarball), DEBIAN_MIRROR],
        capture_output=True, text=True, timeout=MMDEBSTRAP_TIMEOUT_S, stdin=subprocess.DEVNULL,
        env={**buildah.env, "HOME": str(buildah.top / "home")})
    assert proc.returncode == 0, f"mmdebstrap failed:\n{proc.stderr[-4000:]}"
    ctr = buildah("from", "--quiet", "scratch").stdout.strip()
    buildah("add", "--quiet", ctr, str(tarball), "/", timeout=300)
    tarball.unlink()
    env = ["--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "--env", "LANG=C.UTF-8"]
    if HOST_CA_BUNDLE.is_file():
        buildah("copy", "--quiet", ctr, str(HOST_CA_BUNDLE), str(HOST_CA_BUNDLE))
        env += ["--env", f"PIP_CERT={HOST_CA_BUNDLE}"]
    buildah("config", *env, "--cmd", "python3", ctr)
    buildah("commit", "--quiet", "--rm", ctr, names[0], timeout=300)
    for other in names[1:]:
        buildah("tag", names[0], other)


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Iterator[Image]:
    missing = missing_tools()
    if missing and os.environ.get("CI"):  # scripts/test installs them: in CI, absent is a failure
        pytest.fail(f"the image cannot be built here: {missing}")
    if missing:
        pytest.skip(missing)
    system_containers_existed = SYSTEM_CONTAINERS.exists()
    buildah = Buildah(tmp_path_factory.mktemp("image") / "buildah")
    try:
        make_base(buildah, base_images())
        buildah("build", "--isolation", "chroot", "--pull=never", "--layers=false",
                "--file", str(DOCKERFILE), "--tag", IMAGE, str(ROOT), timeout=BUILD_TIMEOUT_S)
        inspected = json.loads(buildah("inspect", "--type", "image", IMAGE).stdout)
        yield Image(buildah, IMAGE, inspected["OCIv1"]["config"])
    finally:
        buildah.clean()
        if not system_containers_existed:  # root's buildah keeps its blob-info cache there
            shutil.rmtree(SYSTEM_CONTAINERS, ignore_errors=True)


@pytest.fixture(scope="module")
def ctr(image: Image) -> str:
    return image.container()


def test_the_image_runs_as_a_non_root_user_with_the_exec_form_entrypoint(image, ctr):
    assert image.config.get("User") == "65532:65532"
    assert image.entrypoint == ["gpu-sidecar", "run"]
    proc = image.buildah.run(ctr, "id", "-u")
    assert (proc.returncode, proc.stdout.strip()) == (0, "65532"), proc.stderr
    proc = image.buildah.run(ctr, "id", "-g")
    assert (proc.returncode, proc.stdout.strip()) == (0, "65532"), proc.stderr
    env = dict(e.split("=", 1) for e in image.config.get("Env", []))
    assert env.get("NVIDIA_DRIVER_CAPABILITIES") == "utility"
    assert "NVIDIA_VISIBLE_DEVICES" not in env


def test_the_entrypoint_prints_the_simulated_samples_this_checkout_prints(image, ctr):
    proc = image.buildah.run(ctr, *image.entrypoint, "--once", "--simulate", "healthy")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    series = prometheus_series(proc.stdout)
    per_gpu = [labels for _, labels in series if "gpu_uuid" in labels]
    assert per_gpu, proc.stdout[-2000:]
    assert all("Simulated" in labels.get("gpu_name", "") for labels in per_gpu)
    here = run_cli("run", "--once", "--simulate", "healthy", "--output", "prometheus")
    assert here.returncode == 0, here.stderr
    assert {n for n, _ in series} == {n for n, _ in prometheus_series(here.stdout)}


def test_probe_reports_the_simulated_gpus(image, ctr):
    proc = image.buildah.run(ctr, image.entrypoint[0], "probe", "--simulate", "healthy")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "probe:" in proc.stdout and "SIMULATED" in proc.stdout, proc.stdout[-2000:]
    assert "Simulated NVIDIA" in proc.stdout


def test_the_manifests_volumes_are_the_images_and_only_they_take_writes(image, ctr):
    mounts = [m["mountPath"] for m in rendered_pod()[1]["volumeMounts"]]
    assert sorted(image.config.get("Volumes") or {}) == sorted(mounts)
    for path in mounts:
        proc = image.buildah.run(ctr, "sh", "-c", f"touch {path}/.written && rm {path}/.written")
        assert proc.returncode == 0, f"{path}: {proc.stderr}"
    for path in ("/", "/opt/gpu-sidecar", "/opt/gpu-sidecar/bin", "/etc", "/usr"):
        proc = image.buildah.run(ctr, "touch", f"{path.rstrip('/')}/.written")
        assert proc.returncode != 0 and "Permission denied" in proc.stderr, f"{path}: {proc.stderr}"


def rendered_pod() -> tuple[dict, dict, dict[str, dict]]:
    """The example Deployment of k8s/base as kustomize renders it: its pod spec, the gpu-sidecar
    container and the ConfigMaps by name."""
    proc = subprocess.run([need("kubectl"), "kustomize", str(ROOT / "k8s" / "base")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    spec = deployment["spec"]["template"]["spec"]
    [container] = [c for c in spec["initContainers"] if c["name"] == "gpu-sidecar"]
    config_maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    return spec, container, config_maps


def kubelet_env(image: Image, container: dict, config_maps: dict[str, dict]) -> dict[str, str]:
    """The container's environment as the kubelet makes it: the image's, then envFrom in order,
    then env (downward-API fields given test values)."""
    env = dict(e.split("=", 1) for e in image.config.get("Env", []))
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef")
        assert ref, f"only configMapRef is handled here: {source}"
        if ref["name"] not in config_maps:
            assert ref.get("optional"), f"ConfigMap {ref['name']} is not rendered"
            continue
        env.update({k: str(v) for k, v in (config_maps[ref["name"]].get("data") or {}).items()})
    for e in container.get("env", []):
        env[e["name"]] = str(e["value"]) if "value" in e else f"image-test-{e['name'].lower()}"
    return env


def children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


@dataclass
class Pod:
    """The gpu-sidecar container of the rendered example Deployment on a read-only root: the
    agent is PID 1 of mount, PID, network and IPC namespaces of its own (``start``), and
    ``exec`` runs a command in those namespaces, at its root, as its user, with its
    environment, as the kubelet execs a probe."""

    image: Image
    container: dict
    env: dict[str, str]
    rootfs: str
    here: Path
    volumes: dict[str, Path]  # mountPath -> the host directory bound there
    agent: subprocess.Popen | None = None
    pid1: int = 0  # the agent, as this machine numbers it

    @property
    def uid_gid(self) -> tuple[int, int]:
        sc = self.container["securityContext"]
        return sc["runAsUser"], sc["runAsGroup"]

    @property
    def command(self) -> list[str]:
        # the kubelet's rule: command replaces the image's ENTRYPOINT, args follow
        return [*(self.container.get("command") or self.image.entrypoint),
                *self.container.get("args", [])]

    def environ(self) -> list[str]:
        return ["/usr/bin/env", "-i", *(f"{k}={v}" for k, v in self.env.items())]

    def start(self) -> None:
        uid, gid = self.uid_gid
        argv = ["unshare", "--mount", "--pid", "--net", "--ipc", "--fork", "--kill-child",
                "--propagation", "private", "sh", str(self.here / "pod.sh"), self.rootfs,
                str(self.here / "root"), f"{uid}:{gid}",
                *(f"{p}={h}" for p, h in self.volumes.items()), "--", *self.environ(),
                *self.command]
        with (self.here / "agent.out").open("w") as out, (self.here / "agent.err").open("w") as err:
            self.agent = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.agent.poll() is None:
            # unshare's child: pod.sh, which mounts, then exec's chroot, env and the entrypoint
            # in turn (one process, PID 1 of the namespace); chroot'ed, the pod is complete
            for pid in children(self.agent.pid):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/root") != "/":
                        self.pid1 = pid
                        return
            time.sleep(0.05)
        raise AssertionError(f"the agent did not start:\n{self.log[-4000:]}")

    def exec(self, *command: str, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        uid, gid = self.uid_gid
        argv = ["nsenter", "--target", str(self.pid1), "--mount", "--pid", "--net", "--ipc",
                "--root", "--wd", "--setuid", str(uid), "--setgid", str(gid), *self.environ(),
                *command]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def host_path(self, path: str) -> Path:
        """Where a path on one of the volumes is on this machine."""
        for mount, host in self.volumes.items():
            if path == mount or path.startswith(mount.rstrip("/") + "/"):
                return host / Path(path).relative_to(mount)
        raise AssertionError(f"{path} is on no volume of the pod")

    @property
    def log(self) -> str:
        return (self.here / "agent.err").read_text()


@pytest.fixture(scope="module")
def pod(image: Image, tmp_path_factory) -> Iterator[Pod]:
    """The agent started with the rendered pod's settings on a read-only root, and running."""
    spec, container, config_maps = rendered_pod()
    here = tmp_path_factory.mktemp("pod")
    ctr = image.container()
    p = None
    try:
        rootfs = image.buildah("mount", ctr).stdout.strip()
        (here / "root").mkdir()
        (here / "pod.sh").write_text(POD_SH)
        volumes = {}
        for m in container["volumeMounts"]:
            host = here / m["name"]
            host.mkdir()
            os.chown(host, 0, spec["securityContext"]["fsGroup"])  # an emptyDir with fsGroup
            host.chmod(0o2770)
            volumes[m["mountPath"]] = host
        env = kubelet_env(image, container, config_maps)
        # a receiver that is never there (the namespace has no network): the batches must wait
        # in the spool volume; and a quick cycle, so that the test is quick
        env.update({"GPU_SIDECAR_REMOTE_WRITE_URL": "http://127.0.0.1:9/api/v1/write",
                    "GPU_SIDECAR_INTERVAL": "0.2", "GPU_SIDECAR_PUSH_INTERVAL": "0.5",
                    "GPU_SIDECAR_RETRY_MAX_BACKOFF": "1"})
        p = Pod(image, container, env, rootfs, here, volumes)
        p.start()
        spool = p.host_path(env["GPU_SIDECAR_SPOOL_DIR"])
        deadline = time.monotonic() + 30
        while (time.monotonic() < deadline and p.agent.poll() is None
               and not list(spool.rglob("*.batch"))):
            time.sleep(0.1)
        assert p.agent.poll() is None, f"the agent exited {p.agent.returncode}:\n{p.log[-4000:]}"
        assert list(spool.rglob("*.batch")), f"nothing spooled in 30 s:\n{p.log[-4000:]}"
        yield p
    finally:
        if p is not None and p.agent is not None and p.agent.poll() is None:
            p.agent.kill()
            p.agent.wait(timeout=10)
        image.buildah("umount", ctr, check=False)
        image.buildah("rm", ctr, check=False)


def test_the_pods_root_takes_no_writes_and_its_volumes_do(pod):
    p = pod
    assert p.container["securityContext"]["readOnlyRootFilesystem"] is True
    assert "{}:{}".format(*p.uid_gid) == p.image.user
    proc = p.exec("id")
    assert proc.stdout.startswith("uid=65532(gpu-sidecar) gid=65532(gpu-sidecar)"), proc.stdout
    # the harness itself: not even where the mode allows it (/tmp)
    proc = p.exec("sh", "-c", "for d in / /tmp /opt/gpu-sidecar; do touch $d/.written; done; true")
    assert proc.stderr.count("Read-only file system") == 3, proc.stderr
    for mount in p.volumes:
        proc = p.exec("sh", "-c", f"touch {mount}/.written && rm {mount}/.written")
        assert proc.returncode == 0, f"{mount}: {proc.stderr}"


def test_on_the_read_only_root_the_agent_places_the_publisher_binds_the_socket_and_spools(pod):
    p = pod
    assert p.agent.poll() is None, p.log[-4000:]
    env = p.env
    assert p.host_path(env["GPU_SIDECAR_SOCKET"]).is_socket(), p.log[-4000:]
    assert (p.host_path(env["GPU_SIDECAR_INJECT_DIR"] + "/sitecustomize.py")).is_file()
    assert list(p.host_path(env["GPU_SIDECAR_SPOOL_DIR"]).rglob("*.batch"))
    assert not re.search(r"Traceback|Read-only file system|Permission denied", p.log), p.log[-4000:]


@pytest.mark.parametrize("probe", ["startupProbe", "livenessProbe"])
def test_the_manifests_probes_pass_beside_the_running_agent(pod, probe):
    p = pod
    if probe not in p.container:
        pytest.skip(f"the manifest declares no {probe}")
    command = p.container[probe]["exec"]["command"]
    proc = p.exec(*command, timeout=p.container[probe].get("timeoutSeconds", 1) + 30)
    assert proc.returncode == 0, f"{probe} {command}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    assert p.agent.poll() is None, p.log[-4000:]


def test_at_sigterm_the_agent_as_pid_1_stops_within_its_shutdown_timeout_and_exits_0(pod):
    p = pod
    [nspid] = [line for line in Path(f"/proc/{p.pid1}/status").read_text().splitlines()
               if line.startswith("NSpid:")]
    assert nspid.split()[-1] == "1", nspid  # the agent is PID 1 of its PID namespace
    os.kill(p.pid1, signal.SIGTERM)
    shutdown = float(p.env.get("GPU_SIDECAR_SHUTDOWN_TIMEOUT", "5"))
    assert p.agent.wait(timeout=shutdown + 10) == 0, p.log[-4000:]
    events = [json.loads(line) for line in p.log.splitlines() if line.startswith("{")]
    assert [e["event"] for e in events][-1] == "stopped", events[-3:]
    assert events[-1].get("signals") == ["SIGTERM"], events[-1]


def test_the_build_context_is_the_package_and_nothing_else(image, tmp_path):
    """What .dockerignore lets in, seen by a throw-away build of the same context."""
    probe = tmp_path / "Containerfile"
    probe.write_text(f"FROM {base_images()[0]}\nCOPY . /context\n"
                     "RUN cd /context && find . -mindepth 1 | sort\n")
    proc = image.buildah("build", "--isolation", "chroot", "--pull=never", "--file", str(probe),
                         str(ROOT), timeout=300)
    seen = {line.removeprefix("./") for line in proc.stdout.splitlines() if line.startswith("./")}
    assert {"pyproject.toml", "README.md", "sidecar", "sidecar/__init__.py"} <= seen
    tops = {p.split("/")[0] for p in seen}
    assert tops == {"pyproject.toml", "README.md", "sidecar"}, tops
    assert not [p for p in seen if "__pycache__" in p or p.endswith((".pyc", ".egg-info"))]
    package = {str(p.relative_to(ROOT)) for p in (ROOT / "sidecar").rglob("*")
               if "__pycache__" not in p.parts and not p.name.endswith(".pyc")}
    assert package <= seen, sorted(package - seen)[:10]


def test_the_how_to_names_the_dockerfiles_base_and_the_manifests_image():
    doc = (ROOT / "docs" / "image.md").read_text()
    for base in base_images(qualify=False):
        assert f"**`{base}`**" in doc, base
    _, container, _ = rendered_pod()
    name = re.sub(r"(@sha256:[0-9a-f]+|:[^/:@]+)$", "", container["image"])
    assert f"- name: {name} " in doc and f"kustomize edit set image {name}=" in doc, name
    for tool in ("docker", "podman", "buildah"):
        assert f'{tool} build -t "$REGISTRY/gpu-sidecar:$VERSION" .' in doc, tool
        assert f'{tool} push "$REGISTRY/gpu-sidecar:$VERSION"' in doc, tool
