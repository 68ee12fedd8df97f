"""The memory guard compares with what this process may really use: available memory, the
address-space limit (``ulimit -v``) and the cgroup's limit, whichever is smallest (issue 21:
a rig estimated at 19 GiB was accepted under a 4 GiB limit and died later)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bevcompile import memory
from bevcompile.errors import UsageError

from .rigs import NUSCENES_YAML, ROOT

GIB = 2**30


def _fake_files(monkeypatch: pytest.MonkeyPatch, files: dict[str, str]) -> None:
    monkeypatch.setattr(memory, "_read", lambda path: files.get(str(path)))


def test_the_smallest_bound_wins_and_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_files(monkeypatch, {
        "/proc/self/status": "VmRSS:\t102400 kB\nVmSize:\t1048576 kB\n",
        "/proc/meminfo": f"MemTotal: {24 * GIB // 1024} kB\nMemAvailable: {20 * GIB // 1024} kB\n",
        "/proc/self/cgroup": "0::/ci.slice/job\n",
        "/sys/fs/cgroup/ci.slice/job/memory.max": f"{4 * GIB}\n",
        "/sys/fs/cgroup/ci.slice/job/memory.current": f"{GIB}\n",
    })
    limit = memory.memory_limit()
    assert limit is not None and limit.what == "the cgroup memory limit"
    assert limit.bytes == 3 * GIB + 100 * 2**20  # the room left in the cgroup, plus what this process holds
    with pytest.raises(UsageError, match=r"^rig needs about 19\.0 GiB, more than the 3\.1 GiB the cgroup memory limit allows; smaller$"):
        memory.refuse_beyond_memory(19 * GIB, "rig", "smaller")
    memory.refuse_beyond_memory(3 * GIB, "rig", "smaller")  # fits: no error


def test_cgroup_v1_and_an_unlimited_v2(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_files(monkeypatch, {
        "/proc/self/status": "VmRSS:\t0 kB\n",
        "/proc/meminfo": "MemAvailable: 1048576 kB\n",
        "/proc/self/cgroup": "5:memory:/docker/abc\n0::/\n",
        "/sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": "536870912\n",
        "/sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes": "268435456\n",
        "/sys/fs/cgroup/memory.max": "max\n",
    })
    assert memory.memory_limit() == memory.MemoryLimit(256 * 2**20, "the cgroup memory limit")


def _grid_under_ulimit(tmp_path: Path, config: Path, x: str, y: str, limit_bytes: int) -> subprocess.CompletedProcess[str]:
    """``bevcompile grid`` of ``config`` with ``bev.x`` / ``bev.y`` replaced, under ``ulimit -v``."""
    text = config.read_text()
    text = re.sub(r"x: \[[^\]]*\]", f"x: {x}", text, count=1)
    text = re.sub(r"y: \[[^\]]*\]", f"y: {y}", text, count=1)
    (tmp_path / "big.yaml").write_text(text)
    bevcompile = Path(sys.executable).parent / "bevcompile"
    return subprocess.run(
        ["bash", "-c", f"ulimit -v {limit_bytes // 1024} && {bevcompile} grid big.yaml --out out"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False, env=dict(os.environ),
    )


def _refused_by_the_address_space_guard(result: subprocess.CompletedProcess[str], grid: str) -> None:
    assert result.returncode == 2, result.stderr
    assert re.fullmatch(
        rf"error: big\.yaml: bevcompile grid of 6 cameras x 1 heights x {grid} needs about [0-9.]+ GiB, more than the "
        r"[0-9.]+ [MG]iB the address-space limit \(RLIMIT_AS, ulimit -v\) allows; use coarser bev steps or fewer heights\n",
        result.stderr,
    ), result.stderr


def test_an_address_space_limit_refuses_a_big_rig_before_any_work(tmp_path: Path) -> None:
    """Under ``ulimit -v 4 GiB`` a 1600 x 1600 nuScenes grid (estimated above 4 GiB, within
    this machine's memory) is one line, exit 2, and nothing is written."""
    result = _grid_under_ulimit(tmp_path, NUSCENES_YAML, "[-51.2, 51.2, 0.064]", "[-51.2, 51.2, 0.064]", 4 * GIB)
    _refused_by_the_address_space_guard(result, "1600 x 1600 cells = 15,360,000 samples")
    assert not (tmp_path / "out").exists()


def test_a_region_of_1e8_cells_is_refused_before_its_cells_are_computed(tmp_path: Path) -> None:
    """issue 31: a bev.region config of 10^8 cells ran 14-26 s and 2.6 GB before the guard refused
    it (the polygon mask, then the cell table, were computed first). Its kept cells are now counted
    from each row's runs and the guard runs before the cell table: under ``ulimit -v 1.5 GiB``
    the refusal is the guard's line (the old code died of MemoryError in the config parser)."""
    config = ROOT / "configs" / "dense-6cam-region.yaml"
    result = _grid_under_ulimit(tmp_path, config, "[-50.0, 50.0, 0.01]", "[-50.0, 50.0, 0.01]", 3 * GIB // 2)
    _refused_by_the_address_space_guard(result, "10000 x 10000 cells = 600,000,000 samples")


# A parent that holds ~400 MiB starts, through bash's exec (as the docs test and CI do), a child that
# prints its peak both ways. CI's README example printed "1003.4 MiB" for a 105 MiB matrix build.
BIG_PARENT = (
    "import subprocess, sys\n"
    "import numpy as np\n"
    "held = np.ones(50_000_000)  # 400 MB resident\n"
    "child = 'import resource; from bevcompile.memory import peak_rss_bytes; '"
    " 'print(peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)'\n"
    "out = subprocess.run(['bash', '-c', f'exec {sys.executable} -c \"{child}\"'], stdout=subprocess.PIPE, text=True, check=True)\n"
    "print(out.stdout, end='')\n"
)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="VmHWM is Linux's /proc")
def test_peak_rss_is_the_commands_own_not_its_parents() -> None:
    out = subprocess.run([sys.executable, "-c", BIG_PARENT], capture_output=True, text=True, timeout=120, check=True)
    own, inherited = (int(v) for v in out.stdout.split())
    assert inherited > 380 * 2**20  # what ru_maxrss says: the parent's 400 MB (why it is not used)
    assert 5 * 2**20 < own < 150 * 2**20  # an interpreter with numpy imported: tens of MiB


def test_peak_rss_grows_with_what_the_process_touches() -> None:
    script = ("import numpy as np; from bevcompile.memory import peak_rss_bytes; before = peak_rss_bytes(); "
              "block = np.ones(25_000_000); print(before, peak_rss_bytes())")  # 200 MB, all touched
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    before, after = (int(v) for v in out.stdout.split())
    assert after >= before + 190 * 2**20
