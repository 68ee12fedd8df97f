"""``bevcompile.files``: user-named files are read only when regular and bounded, outputs never
replace a device, FIFO or socket, and JSON is read strictly and without recursion (issue 31).

Device nodes are this test's own (``mknod`` in ``tmp_path``, skipped where the user may not
create one), never the machine's ``/dev``."""

from __future__ import annotations

import json
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from bevcompile.cli import app
from bevcompile.files import (
    MISSING,
    SPECIAL,
    TOO_LARGE,
    FileRefused,
    JSONRefused,
    check_output_path,
    json_depth,
    loads_strict,
    object_depth,
    read_regular,
    replace_file,
)

from .rigs import small_rig_data, write_yaml

runner = CliRunner()

NULL, FULL, ZERO = (1, 3), (1, 7), (1, 5)


def make_device(path: Path, numbers: tuple[int, int] = NULL) -> Path:
    """A character device node of our own (``/dev/null`` by default) at ``path``."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(*numbers))
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD (root)")
    return path


def is_device(path: Path) -> bool:
    return stat.S_ISCHR(os.stat(path).st_mode)


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


@pytest.fixture
def sock(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "s"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    yield path
    server.close()


# --------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------


def test_special_files_are_refused_before_a_byte_is_read(tmp_path: Path, fifo: Path, sock: Path) -> None:
    """A FIFO (the open itself would block without O_NONBLOCK), a socket and /dev/zero (a read
    that never ends) are refused by kind; a missing file and an oversized one by their code."""
    zero = make_device(tmp_path / "zero", ZERO)
    for path, kind in ((fifo, "a FIFO"), (sock, "a socket"), (zero, "a character device")):
        with pytest.raises(FileRefused) as info:
            read_regular(path, 1 << 20, "a test file")
        assert info.value.code == SPECIAL and info.value.reason == f"is {kind}, not a regular file (a test file is a file)"
    big = tmp_path / "big"
    big.write_bytes(b"x" * 1025)
    with pytest.raises(FileRefused) as info:
        read_regular(big, 1024, "a test file")
    assert info.value.code == TOO_LARGE and info.value.size == 1025 and "1,025 bytes, more than the 1 KiB" in info.value.reason
    with pytest.raises(FileRefused) as info:
        read_regular(tmp_path / "nope", 10, "a test file")
    assert info.value.code == MISSING
    assert read_regular(big, 2048, "a test file") == b"x" * 1025


def test_a_link_to_a_device_is_read_as_the_device(tmp_path: Path) -> None:
    link = tmp_path / "link.yaml"
    link.symlink_to(make_device(tmp_path / "zero", ZERO))
    with pytest.raises(FileRefused, match="a character device"):
        read_regular(link, 1 << 20, "a rig config")


# --------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------


def test_output_checks_refuse_devices_fifos_and_sockets_and_replace_checks_again(tmp_path: Path, fifo: Path, sock: Path) -> None:
    device = make_device(tmp_path / "null")
    for path in (device, fifo, sock):
        assert check_output_path(path) is not None
    link = tmp_path / "link"
    link.symlink_to(device)
    assert "character device" in str(check_output_path(link))
    assert check_output_path(tmp_path / "new.onnx") is None
    (tmp_path / "old").write_text("x")
    assert check_output_path(tmp_path / "old") is None
    tmp = tmp_path / ".tmp"
    tmp.write_text("new")
    with pytest.raises(FileRefused):
        replace_file(tmp, device)
    assert is_device(device) and tmp.exists()
    replace_file(tmp, tmp_path / "old")
    assert (tmp_path / "old").read_text() == "new"


def _cv_file(tmp_path: Path) -> Path:
    path = tmp_path / "cam.yaml"
    path.write_text("%YAML:1.0\ncamera_matrix: [[1000, 0, 800], [0, 1000, 450], [0, 0, 1]]\nimage_width: 1600\nimage_height: 900\n")
    return path


@pytest.mark.parametrize("numbers", [NULL, FULL])
def test_import_out_to_a_device_is_refused_and_the_node_survives(tmp_path: Path, numbers: tuple[int, int]) -> None:
    """issue 31: `import --out /dev/full` (as root) turned the device into a regular file, exit 0."""
    node = make_device(tmp_path / "node", numbers)
    result = runner.invoke(app, ["import", "opencv", str(_cv_file(tmp_path)), "--camera", "CAM_FRONT", "--out", str(node)])
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: --out {node}: is a character device; bevcompile writes a file by renaming a new one over the path, which would replace it: give a regular file name\n"
    assert is_device(node)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".node")]  # no temporary left


def test_render_out_to_a_device_or_fifo_is_refused_and_the_node_survives(tmp_path: Path, small_store: Path) -> None:
    node = make_device(tmp_path / "coverage.png")
    result = runner.invoke(app, ["render", str(small_store), "--out", str(node)])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: --out {node}: is a character device;") and is_device(node)
    pipe = tmp_path / "pipe.png"
    os.mkfifo(pipe)
    result = runner.invoke(app, ["render", str(small_store), "--out", str(pipe)])
    assert result.exit_code == 2 and "is a FIFO" in result.stderr and stat.S_ISFIFO(os.stat(pipe).st_mode)


def test_export_onnx_out_to_a_device_is_refused_before_any_work(tmp_path: Path, small_store: Path) -> None:
    pytest.importorskip("onnx")
    node = make_device(tmp_path / "model.onnx", FULL)
    result = runner.invoke(app, ["export-onnx", str(small_store), "--out", str(node), "--quiet"])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: --out {node}: is a character device;") and is_device(node)


def test_export_interop_npy_over_a_device_is_refused_before_the_store_changes(tmp_path: Path, small_store: Path) -> None:
    from .damage import copy_store
    from .rigs import tree_digest

    store = copy_store(small_store, tmp_path / "s" / "small.zarr")
    before = tree_digest(store)
    folder = tmp_path / "npy"
    folder.mkdir()
    node = make_device(folder / "petr_coords3d.npy")
    result = runner.invoke(app, ["export-interop", str(store), "--to", "petr-coords3d", "--npy", str(folder), "--quiet"])
    assert result.exit_code == 2, result.output
    assert f"{node}: is a character device" in result.stderr and is_device(node)
    assert tree_digest(store) == before


@pytest.fixture(scope="module")
def small_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bevcompile.grid.build import run_grid

    from .rigs import small_rig

    return run_grid(small_rig(), tmp_path_factory.mktemp("files")).store


# --------------------------------------------------------------------------------------
# readers of the commands: FIFOs and devices end in one line, exit 2
# --------------------------------------------------------------------------------------


def test_depth_prior_fifo_device_and_oversize_are_refused_unread(tmp_path: Path, fifo: Path) -> None:
    """issue 31: `matrix --mode ray --depth-prior <fifo>` hung, `/dev/zero` grew to 3.8 GB."""
    config = write_yaml(tmp_path / "rig.yaml", small_rig_data())
    zero = make_device(tmp_path / "zero", ZERO)
    big = tmp_path / "big.npy"
    np.save(big, np.ones(200_000))  # more than any (n_cam, D, H_f, W_f) prior of the small rig (+ 1 MiB header room)
    for path, reason in ((fifo, "is a FIFO, not a regular file"), (zero, "is a character device"), (big, "1,600,128 bytes, more than")):
        result = runner.invoke(app, ["matrix", str(config), "--out", str(tmp_path), "--mode", "ray", "--depth-prior", str(path)])
        assert result.exit_code == 2, result.output
        assert result.stderr.startswith(f"error: {path}: ") and reason in result.stderr and result.stderr.count("\n") == 1


def test_absorb_fifo_and_device_are_refused_unread(tmp_path: Path, fifo: Path, small_store: Path) -> None:
    """issue 31: `absorb STORE <fifo>` hung; `absorb STORE /dev/zero` ran forever."""
    from bevcompile.matrix.build import MatrixOptions, run_matrix

    from .damage import copy_store
    from .rigs import small_rig, tree_digest

    store = copy_store(small_store, tmp_path / "s" / "small.zarr")
    run_matrix(small_rig(), store.parent, MatrixOptions(topk=4))
    before = tree_digest(store)
    zero = make_device(tmp_path / "zero", ZERO)
    for path, kind in ((fifo, "a FIFO"), (zero, "a character device")):
        result = runner.invoke(app, ["absorb", str(store), str(path)])
        assert result.exit_code == 2, result.output
        assert result.stderr == f"error: {path}: is {kind}, not a regular file (a checkpoint file is a file)\n"
    assert tree_digest(store) == before


def test_nuscenes_table_fifo_is_refused(tmp_path: Path) -> None:
    """issue 31: `import nuscenes` hung on a table that is a FIFO."""
    version = tmp_path / "v1.0-mini"
    version.mkdir()
    for table in ("sample", "sample_data", "calibrated_sensor", "sensor", "log"):
        (version / f"{table}.json").write_text("[]")
    os.mkfifo(version / "scene.json")
    result = runner.invoke(app, ["import", "nuscenes", "--dataroot", str(tmp_path), "--version", "v1.0-mini", "--scene", "s"])
    assert result.exit_code == 2
    assert result.stderr == f"error: {version / 'scene.json'}: is a FIFO, not a regular file (a nuScenes table is a file)\n"


# --------------------------------------------------------------------------------------
# strict, recursion-proof JSON
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"\xef\xbb\xbf{}", "byte-order mark"),
        (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
        (b'{"a": NaN}', "NaN: strict JSON has no NaN or Infinity"),
        (b'{"a": -Infinity}', "-Infinity: strict JSON"),
        (b'{"a": 1e999}', "overflows a float64"),
        (b'{"a": ' + b"9" * 5001 + b"}", "an integer of 5,001 digits"),
        (b"[" * 200_000 + b"]" * 200_000, "nested 200,000 levels deep, more than 64"),
        (b"[" * 65 + b"]" * 65, "nested 65 levels deep"),
        (b'{"a": 1} x', "extra data"),
        (b'{"a": "\xff"}', "not UTF-8 (byte 0xff"),
        (b"{", "not JSON"),
    ],
)
def test_strict_json_refusals_are_one_line(raw: bytes, reason: str) -> None:
    with pytest.raises(JSONRefused) as info:
        loads_strict(raw)
    assert reason in str(info.value) and "\n" not in str(info.value) and len(str(info.value)) < 200


def test_strict_json_reads_what_json_dumps_writes() -> None:
    value = {"config": {"cameras": [{"name": "CAM_前", "k": [[1.5, 0, 2**62]]}]}, "s": '"[{\\', "b": [True, None]}
    raw = json.dumps(value).encode()
    assert loads_strict(raw) == value and json_depth(raw) == 6 and object_depth(value) == 6
    assert loads_strict(b"[" * 64 + b"]" * 64) is not None
    assert json_depth(b'["[[[[", "{{{{"]') == 1  # brackets inside strings do not nest
