"""Build every package, check the artifacts, publish them to a local index for real, install from it.

The index is pypiserver on 127.0.0.1 (a free port, an htpasswd upload password, no fallback to PyPI),
started and stopped here. ``twine upload`` sends the ten artifacts over HTTP exactly as to PyPI. A fresh
venv then gets ``pip install --index-url <local>/simple/ verl-dyncp``: pip resolves verl-dyncp,
verl-mcore-utils and verl-config from that index alone (its install report shows each download URL). The
third-party requirements (torch, megatron-core, ...) are installed before, at the uv.lock versions from
uv's cache, because the local index holds only our packages and CI should not download torch again.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import check_dist  # noqa: E402
import smoke_install  # noqa: E402
from workspace_packages import read_packages  # noqa: E402

pytestmark = pytest.mark.release
PACKAGES = read_packages()
SERVER_START_S = 30
# What a downstream trainer does with verl-dyncp on CPU: plan dynamic CP for a packed micro-batch, build
# every CP rank's zigzag layout, and check that together they cover each token once at its true position.
DOWNSTREAM = """
import torch
from verl_dyncp import build_thd_meta, plan_dynamic_cp

seq_lens = [700, 90, 300, 64, 33, 250, 120]
# the size by need alone: 700 tokens need 3 -> 4 ranks of 256
plan = plan_dynamic_cp(seq_lens, dp_cp_size=8, max_seqlen_per_dp_cp_rank=256, larger_cp_min_gain=None)
assert plan.cp_size == 4 and plan.num_groups == 2, plan
# the default doubles it while that balances better: the 700-token sequence outweighs half the work here
assert plan_dynamic_cp(seq_lens, dp_cp_size=8, max_seqlen_per_dp_cp_rank=256).cp_size == 8
assert sorted(i for group in plan.assignments for i in group) == list(range(len(seq_lens)))
for group in plan.assignments:
    lens = [seq_lens[i] for i in group]
    metas = [build_thd_meta(seq_lens=lens, cp_size=plan.cp_size, cp_rank=r) for r in range(plan.cp_size)]
    assert len({len(m.position_ids) for m in metas}) == 1  # zigzag: every rank holds as many tokens
    starts = metas[0].cu_seqlens.long()
    seen = []
    for meta in metas:
        real = ~meta.is_padding
        source = meta.source_index[real]
        sequence = torch.searchsorted(starts[1:], source, right=True)
        assert torch.equal(meta.position_ids[real], source - starts[sequence])
        seen.append(source)
    assert sorted(torch.cat(seen).tolist()) == list(range(sum(lens)))
print("downstream ok", plan.assignments)
"""


def _run(cmd: list[str], *, cwd: Path | None = None, timeout: float = 300) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wheel + sdist of every package, built as for a release (no workspace sources)."""
    out = tmp_path_factory.mktemp("dist")
    _run(
        [smoke_install.uv(), "build", "--all-packages", "--no-sources", "--quiet", "--out-dir", str(out)],
        cwd=ROOT,
    )
    return out


def _artifacts(dist: Path) -> list[Path]:
    return sorted([*dist.glob("*.whl"), *dist.glob("*.tar.gz")])


def test_ten_artifacts_pass_twine_and_the_content_check(dist: Path) -> None:
    artifacts = _artifacts(dist)
    expected = {f"{p.module}-{p.version}-py3-none-any.whl" for p in PACKAGES.values()}
    expected |= {f"{p.module}-{p.version}.tar.gz" for p in PACKAGES.values()}
    assert {a.name for a in artifacts} == expected
    _run([sys.executable, "-m", "twine", "check", "--strict", *map(str, artifacts)])
    assert check_dist.check_paths(artifacts, require_all=True) == []


def test_content_check_names_each_bad_file(dist: Path, tmp_path: Path) -> None:
    package = PACKAGES["verl-dyncp"]
    wheel = dist / f"{package.module}-{package.version}-py3-none-any.whl"
    bad_wheel = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(bad_wheel, "w") as dst:
        for item in src.infolist():
            if item.filename != "verl_dyncp/py.typed":
                dst.writestr(item, src.read(item))
        dst.writestr("verl_dyncp/__pycache__/planner.cpython-312.pyc", b"")
        dst.writestr("tests/test_planner.py", "")
        dst.writestr("notes.txt", "")
    sdist = dist / f"{package.module}-{package.version}.tar.gz"
    bad_sdist = tmp_path / sdist.name
    with tarfile.open(sdist) as src, tarfile.open(bad_sdist, "w:gz") as dst:
        for member in src.getmembers():
            if not member.name.endswith("/LICENSE"):
                dst.addfile(member, src.extractfile(member) if member.isfile() else None)
        extra = tmp_path / "scratch.py"
        extra.write_text("")
        dst.add(extra, arcname=f"{package.module}-{package.version}/src/verl_dyncp/scratch.py")
    problems = "\n".join(check_dist.check_paths([bad_wheel, bad_sdist]))
    assert "verl_dyncp/__pycache__/planner.cpython-312.pyc is a test or cache file" in problems
    assert "tests/test_planner.py is a test or cache file" in problems
    assert "notes.txt is a stray file" in problems
    assert "no verl_dyncp/py.typed" in problems
    assert f"{sdist.name}: src/verl_dyncp/scratch.py is not tracked by git" in problems
    assert f"{sdist.name}: no {package.module}-{package.version}/LICENSE" in problems
    assert check_dist.main([str(bad_wheel)]) == 1


def test_smoke_install_passes_verl_config_alone_and_refuses_one_that_pulls_torch(
    dist: Path, tmp_path: Path
) -> None:
    package = PACKAGES["verl-config"]
    wheel = dist / f"{package.module}-{package.version}-py3-none-any.whl"
    good = tmp_path / "good"
    good.mkdir()
    shutil.copy(wheel, good / wheel.name)
    smoke_install.smoke_config(good, work=tmp_path / "venvs")
    # The same wheel with one more requirement, torch: its install from the wheels alone must fail.
    bad = tmp_path / "bad"
    bad.mkdir()
    metadata = f"{package.module}-{package.version}.dist-info/METADATA"
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(bad / wheel.name, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename == metadata:
                data = data.replace(b"Requires-Dist: ", b"Requires-Dist: torch>=2.6\nRequires-Dist: ", 1)
            dst.writestr(item, data)
    with pytest.raises(smoke_install.SmokeError, match=r"install verl-config .* failed[\s\S]*torch"):
        smoke_install.smoke_config(bad, work=tmp_path / "venvs")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def index(tmp_path: Path) -> Iterator[tuple[str, str, str]]:
    """A pypiserver on 127.0.0.1 that takes uploads with a password: (url, user, password)."""
    from passlib.apache import HtpasswdFile

    user, password = "ci", secrets.token_hex(8)
    htpasswd = HtpasswdFile(str(tmp_path / "htpasswd"), new=True)
    htpasswd.set_password(user, password)
    htpasswd.save()
    packages = tmp_path / "index"
    packages.mkdir()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = shutil.which("pypi-server", path=os.path.dirname(sys.executable))
    assert server, "pypi-server is not installed next to this python; uv sync --group release"
    log = (tmp_path / "server.log").open("w")
    cmd = [
        server,
        "run",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--passwords",
        str(tmp_path / "htpasswd"),
    ]
    cmd += ["--authenticate", "update", "--disable-fallback", str(packages)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                raise AssertionError(
                    f"pypi-server exited with {proc.returncode}:\n{(tmp_path / 'server.log').read_text()}"
                )
            try:
                with urllib.request.urlopen(f"{url}/simple/", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"pypi-server did not answer on {url} within {SERVER_START_S} s")
            time.sleep(0.2)
        yield url, user, password
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


# passlib (pypiserver's htpasswd reader) imports the stdlib crypt module, deprecated in 3.12.
@pytest.mark.filterwarnings("ignore:'crypt' is deprecated:DeprecationWarning")
def test_publish_to_a_local_index_then_pip_install_verl_dyncp_from_it(
    dist: Path, index: tuple[str, str, str], tmp_path: Path
) -> None:
    url, user, password = index
    artifacts = _artifacts(dist)
    upload = [sys.executable, "-m", "twine", "upload", "--non-interactive", "--disable-progress-bar"]
    upload += ["--repository-url", f"{url}/", "--username", user, "--password", password]
    _run([*upload, *map(str, artifacts)])
    with urllib.request.urlopen(f"{url}/simple/verl-dyncp/", timeout=10) as response:
        listing = response.read().decode()
    dyncp = PACKAGES["verl-dyncp"]
    assert f"{dyncp.module}-{dyncp.version}-py3-none-any.whl" in listing
    assert f"{dyncp.module}-{dyncp.version}.tar.gz" in listing
    # A wrong password is refused: the upload above really went through the index's authentication.
    bad = subprocess.run(
        [*upload[:-1], "wrong", str(artifacts[0])], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode != 0 and ("403" in bad.stdout + bad.stderr or "401" in bad.stdout + bad.stderr)

    python = smoke_install.create_venv(tmp_path / "venv", seed=True)  # seed: the venv gets its own pip
    smoke_install.install_third_party(python, package="verl-dyncp")
    report = tmp_path / "report.json"
    _run(
        [str(python), "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check", "--index-url",
         f"{url}/simple/", "--report", str(report), "verl-dyncp"],
        cwd=tmp_path,
    )  # fmt: skip
    installed = {
        item["metadata"]["name"]: item["download_info"]["url"]
        for item in json.loads(report.read_text())["install"]
    }
    assert set(installed) == {"verl-dyncp", "verl-mcore-utils", "verl-config"}, installed
    for name, link in installed.items():
        module, version = PACKAGES[name].module, PACKAGES[name].version
        assert link == f"{url}/packages/{module}-{version}-py3-none-any.whl", (name, link)
    absent = _run([str(python), "-m", "pip", "list", "--format", "freeze"])
    assert "verl-engine" not in absent and "verl-mfsdp" not in absent
    empty = tmp_path / "trainer"
    empty.mkdir()
    out = _run([str(python), "-c", DOWNSTREAM], cwd=empty)
    assert out.startswith("downstream ok"), out
