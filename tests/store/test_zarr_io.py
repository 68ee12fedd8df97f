"""The zarr store: contract, determinism, atomic writes, conflicts, damage detection on read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import bevcompile.store.zarr_io as store_module
from bevcompile.conventions import CONVENTIONS
from bevcompile.errors import StoreConflictError, StoreError
from bevcompile.grid.build import run_grid
from bevcompile.rig.config import config_sha256, config_to_dict, parse_config
from bevcompile.store.root import root_attributes
from bevcompile.store.zarr_io import GroupData, array_sha256, default_chunks, open_store, write_groups

from ..rigs import group_data, small_rig, small_rig_data, tree_digest


def test_store_contract(tmp_path: Path) -> None:
    rig = small_rig(heights=(0.0, 1.0))
    result = run_grid(rig, tmp_path)
    reader = open_store(tmp_path / "small.zarr")
    attrs = reader.root_attrs
    assert attrs["format"] == "bevcompile/1"
    assert attrs["name"] == "small"
    assert attrs["config"] == config_to_dict(rig)
    assert attrs["config_sha256"] == config_sha256(rig)
    assert attrs["conventions"] == CONVENTIONS
    assert isinstance(attrs["tool_version"], str)
    assert reader.groups() == ["delta", "gather", "grid"]
    shapes = {
        name: (reader.array_info("grid", name).shape, reader.array_info("grid", name).dtype)
        for name in ("coords", "valid", "norm", "norm_int16")
    }
    assert shapes == {
        "coords": ((4, 2, 24, 24, 2), "float32"),
        "valid": ((4, 2, 24, 24), "bool"),
        "norm": ((4, 2, 24, 24, 2), "float32"),
        "norm_int16": ((4, 2, 24, 24, 2), "int16"),
    }
    grid_attrs = reader.group_attrs("grid")
    assert grid_attrs["align_corners"] is False
    assert grid_attrs["feature_size"] == [12, 8]
    assert grid_attrs["build_options"] == {"align_corners": False}
    assert grid_attrs["norm_int16"]["max_error_px"] == result.products.norm_int16_max_error_px
    np.testing.assert_array_equal(reader.read("grid", "valid", verify_sha256=True), result.products.valid)
    # the stored config re-parses to the same config
    assert config_sha256(parse_config(attrs["config"])) == attrs["config_sha256"]


def test_output_is_byte_identical_across_runs(tmp_path: Path) -> None:
    rig = small_rig(distortion=True, heights=(0.0, 0.5))
    run_grid(rig, tmp_path / "a")
    run_grid(rig, tmp_path / "b")
    a = tree_digest(tmp_path / "a" / "small.zarr")
    b = tree_digest(tmp_path / "b" / "small.zarr")
    assert a == b and len(a) > 8


def test_other_config_is_refused_without_force(tmp_path: Path) -> None:
    run_grid(small_rig(), tmp_path)
    before = tree_digest(tmp_path / "small.zarr")
    other = small_rig(bev_step_m=2.0)
    with pytest.raises(StoreConflictError, match=r"small\.zarr: was built from a different config .* pass --force"):
        run_grid(other, tmp_path)
    assert tree_digest(tmp_path / "small.zarr") == before
    run_grid(other, tmp_path, force=True)
    assert open_store(tmp_path / "small.zarr").root_attrs["config_sha256"] == config_sha256(other)


def test_same_config_keeps_other_groups_and_replaces_its_own(tmp_path: Path) -> None:
    rig = small_rig()
    path = tmp_path / "small.zarr"
    run_grid(rig, tmp_path)
    write_groups(path, root_attrs=root_attributes(rig), groups={"extra": group_data({"x": np.arange(5)})})
    run_grid(rig, tmp_path, align_corners=True)
    reader = open_store(path)
    assert reader.groups() == ["delta", "extra", "gather", "grid"]
    assert reader.group_attrs("grid")["align_corners"] is True
    np.testing.assert_array_equal(reader.read("extra", "x"), np.arange(5))


def test_failed_write_leaves_the_old_store_untouched_and_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rig = small_rig()
    run_grid(rig, tmp_path)
    before = tree_digest(tmp_path / "small.zarr")
    calls = {"n": 0}
    real = store_module._write_group

    def exploding(root, name, data, *coords):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        real(root, name, data, *coords)
        raise RuntimeError("disk full (simulated)")

    monkeypatch.setattr(store_module, "_write_group", exploding)
    with pytest.raises(RuntimeError, match="simulated"):
        run_grid(rig, tmp_path, align_corners=True)
    assert calls["n"] == 1
    assert tree_digest(tmp_path / "small.zarr") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.zarr"]


def test_failed_first_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def exploding(root, name, data, *coords):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    monkeypatch.setattr(store_module, "_write_group", exploding)
    with pytest.raises(KeyboardInterrupt):
        run_grid(small_rig(), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_non_store_directory_is_not_overwritten_without_force(tmp_path: Path) -> None:
    (tmp_path / "small.zarr").mkdir()
    (tmp_path / "small.zarr" / "precious.txt").write_text("keep me")
    with pytest.raises(StoreConflictError, match="not a readable bevcompile store"):
        run_grid(small_rig(), tmp_path)
    assert (tmp_path / "small.zarr" / "precious.txt").read_text() == "keep me"


def test_a_foreign_zarr_store_is_not_overwritten_without_force(tmp_path: Path) -> None:
    import zarr

    foreign = zarr.open_group(str(tmp_path / "small.zarr"), mode="w", zarr_format=3)
    foreign.create_array("precious", data=np.arange(10))
    with pytest.raises(StoreConflictError, match="is not a bevcompile store \\(no config_sha256"):
        run_grid(small_rig(), tmp_path)
    assert np.array_equal(zarr.open_group(str(tmp_path / "small.zarr"), mode="r")["precious"][:], np.arange(10))
    run_grid(small_rig(), tmp_path, force=True)
    assert "precious" not in zarr.open_group(str(tmp_path / "small.zarr"), mode="r")


def test_writer_refuses_non_finite_values(tmp_path: Path) -> None:
    rig = small_rig()
    with pytest.raises(StoreError, match="non-finite"):
        write_groups(
            tmp_path / "s.zarr", root_attrs=root_attributes(rig), groups={"g": group_data({"x": np.array([1.0, np.nan])})}
        )
    assert not (tmp_path / "s.zarr").exists()


def test_reading_detects_missing_and_garbage_chunks(tmp_path: Path) -> None:
    run_grid(small_rig(), tmp_path)
    path = tmp_path / "small.zarr"
    chunk_files = sorted((path / "grid" / "coords" / "c").rglob("*"))
    chunk_files = [p for p in chunk_files if p.is_file()]
    assert len(chunk_files) == 4  # one chunk per camera
    chunk_files[1].unlink()
    with pytest.raises(StoreError, match=r"grid/coords: 1 of 4 chunk\(s\) missing"):
        open_store(path).read("grid", "coords")
    norm_chunk = next(p for p in (path / "grid" / "norm" / "c").rglob("*") if p.is_file())
    norm_chunk.write_bytes(norm_chunk.read_bytes()[:10])
    with pytest.raises(StoreError, match=r"grid/norm: chunk data unreadable"):
        open_store(path).read("grid", "norm")


def test_reading_detects_content_edits(tmp_path: Path) -> None:
    rig = small_rig()
    path = tmp_path / "small.zarr"
    run_grid(rig, tmp_path)
    # rewrite one array through zarr with different values but the old sha256 attribute
    import zarr

    array = zarr.open_array(str(path / "grid" / "valid"), mode="r+")
    array[0, 0, 0, 0] = ~array[0, 0, 0, 0]
    with pytest.raises(StoreError, match=r"content sha256 .* does not match recorded"):
        open_store(path).read("grid", "valid", verify_sha256=True)


def test_not_a_store(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no such store"):
        open_store(tmp_path / "missing.zarr")
    (tmp_path / "empty.zarr").mkdir()
    with pytest.raises(StoreError, match=r"no zarr\.json at its root"):
        open_store(tmp_path / "empty.zarr")


def test_array_sha256_covers_dtype_and_shape() -> None:
    a = np.arange(6, dtype=np.int16)
    assert array_sha256(a) != array_sha256(a.reshape(2, 3))
    assert array_sha256(a) != array_sha256(a.astype(np.uint16))
    assert array_sha256(a) == array_sha256(a.astype(">i2"))


def test_default_chunks_bound_the_chunk_size() -> None:
    assert default_chunks((6, 1, 128, 128, 2), 4) == (6, 1, 128, 128, 2)
    chunks = default_chunks((200000, 64), 4, target_bytes=1 << 20)
    assert chunks == (4096, 64)
    assert default_chunks((0, 4), 4) == (1, 4)


def test_small_rig_data_is_valid_yaml_material() -> None:
    assert parse_config(small_rig_data()).name == "small"


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_leftovers_of_a_killed_writer_are_cleaned_and_a_moved_store_restored(tmp_path: Path) -> None:
    """SIGKILL cannot be caught: the next write of the same store removes a dead writer's
    temporary, and puts back a store the writer had moved aside between its two renames."""
    import os
    import shutil

    rig = small_rig()
    run_grid(rig, tmp_path)
    store = tmp_path / "small.zarr"
    before = tree_digest(store)
    host = store_module._host_tag()
    dead = f"{_dead_pid()}-{host}"
    shutil.copytree(store, tmp_path / f".small.zarr.tmp-{dead}-deadbeef")
    os.rename(store, tmp_path / f".small.zarr.old-{dead}-cafebabe")  # killed between the renames
    live = tmp_path / f".small.zarr.tmp-{os.getpid()}-{host}-0badf00d"  # a running writer: left alone
    live.mkdir()
    other_host = tmp_path / f".small.zarr.tmp-{_dead_pid()}-another_machine-0badcafe"  # a pid of another host means nothing here
    other_host.mkdir()
    touched = store_module.recover_interrupted_writes(store)
    assert sorted(p.name for p in touched) == [f".small.zarr.old-{dead}-cafebabe", f".small.zarr.tmp-{dead}-deadbeef"]
    assert tree_digest(store) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other_host.name, "small.zarr"])
    # a write does the same sweep (and keeps the restored store's config check)
    shutil.copytree(store, tmp_path / f".small.zarr.tmp-{dead}-deadbee2")
    run_grid(rig, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other_host.name, "small.zarr"])


def test_a_store_moved_aside_by_a_killed_writer_is_judged_before_the_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed between the two renames: the early config check puts the store back first, so a
    different config is refused before any work (not after a full build)."""
    import os

    import bevcompile.grid.build as build_module

    run_grid(small_rig(), tmp_path)
    host = store_module._host_tag()
    os.rename(tmp_path / "small.zarr", tmp_path / f".small.zarr.old-{_dead_pid()}-{host}-cafebabe")

    def must_not_build(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("built before refusing")

    monkeypatch.setattr(build_module, "build_grid_command", must_not_build)
    with pytest.raises(StoreConflictError, match="different config"):
        run_grid(small_rig(heights=(0.0, 2.0)), tmp_path)
    assert (tmp_path / "small.zarr").is_dir()


def test_an_interrupt_after_the_swap_says_the_store_was_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rig = small_rig()
    run_grid(rig, tmp_path)
    real_rmtree = store_module.shutil.rmtree

    def interrupted_rmtree(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if ".old-" in str(path):
            raise KeyboardInterrupt
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(store_module.shutil, "rmtree", interrupted_rmtree)
    with pytest.raises(KeyboardInterrupt) as info:
        run_grid(rig, tmp_path, align_corners=True)
    assert getattr(info.value, store_module.STORE_WRITTEN_ATTR) == str(tmp_path / "small.zarr")
    assert open_store(tmp_path / "small.zarr").group_attrs("grid")["align_corners"] is True  # the new store, complete
    monkeypatch.setattr(store_module.shutil, "rmtree", real_rmtree)
    (left,) = [p for p in tmp_path.iterdir() if ".old-" in p.name]  # the old copy, of this (live) process
    host = store_module._host_tag()
    left.rename(tmp_path / f".small.zarr.old-{_dead_pid()}-{host}-cafebabe")  # as after the process exited
    run_grid(rig, tmp_path, align_corners=True)  # the next write removes it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.zarr"]


@pytest.mark.parametrize("existing", [True, False])
def test_a_sigterm_held_during_the_swap_says_the_store_was_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existing: bool) -> None:
    """issue 31: a SIGTERM that waited for the swap's signal mask was raised as the mask lifted,
    before the write was recorded: the command said "no store was left half-written" (or "cannot
    write store") though the new store was complete. The write is recorded inside the mask."""
    import os
    import signal

    from typer.testing import CliRunner

    from bevcompile.cli import app

    from ..rigs import write_yaml

    config = write_yaml(tmp_path / "small.yaml", small_rig_data())
    out = tmp_path / "out"
    runner = CliRunner()
    if existing:
        assert runner.invoke(app, ["grid", str(config), "--out", str(out), "--quiet"]).exit_code == 0
    real_rename = store_module.os.rename

    def rename(a, b):  # type: ignore[no-untyped-def]
        real_rename(a, b)
        if Path(b).name == "small.zarr":  # the new store is in place; the signal waits for the mask
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(store_module, "_exchange", lambda a, b: False)  # the two-rename swap: a rename puts it in place
    monkeypatch.setattr(store_module.os, "rename", rename)
    result = runner.invoke(app, ["grid", str(config), "--out", str(out), "--quiet", "--align-corners"])
    assert result.exit_code == 143, result.output
    store = out / "small.zarr"
    assert result.stderr == f"error: terminated (SIGTERM); {store} was already written completely (its old copy is removed by the next write)\n"
    assert open_store(store).group_attrs("grid")["align_corners"] is True


def test_a_failure_to_delete_the_old_copy_is_no_failure_of_the_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """issue 31: an interrupted deletion of the old copy surfaced as "cannot write store (Bad file
    descriptor)", exit 2, though the new store was complete."""
    import errno

    rig = small_rig()
    run_grid(rig, tmp_path)
    real_rmtree = store_module.shutil.rmtree

    def failing_rmtree(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if ".old-" in str(path):
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(store_module.shutil, "rmtree", failing_rmtree)
    result = run_grid(rig, tmp_path, align_corners=True)
    assert result.store == tmp_path / "small.zarr"
    assert open_store(tmp_path / "small.zarr").group_attrs("grid")["align_corners"] is True


def test_another_configs_store_is_refused_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bevcompile.grid.build as build_module
    import bevcompile.matrix.build as matrix_module
    from bevcompile.matrix.build import MatrixOptions, run_matrix

    run_grid(small_rig(), tmp_path)

    def must_not_build(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("built before refusing")

    monkeypatch.setattr(build_module, "build_grid_command", must_not_build)
    monkeypatch.setattr(matrix_module, "build_matrix", must_not_build)
    other = small_rig(heights=(0.0, 2.0))
    with pytest.raises(StoreConflictError, match="different config"):
        run_grid(other, tmp_path)
    with pytest.raises(StoreConflictError, match="different config"):
        run_matrix(other, tmp_path, MatrixOptions(topk=2))


def test_sigterm_during_a_write_leaves_the_old_store_and_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CI timeout or `docker stop` sends SIGTERM: one line, exit 143, the earlier store untouched."""
    import os
    import signal

    from typer.testing import CliRunner

    from bevcompile.cli import app

    from ..rigs import write_yaml

    config = write_yaml(tmp_path / "small.yaml", small_rig_data())
    out = tmp_path / "out"
    runner = CliRunner()
    assert runner.invoke(app, ["grid", str(config), "--out", str(out), "--quiet"]).exit_code == 0
    before = tree_digest(out / "small.zarr")

    def terminated(root, name, data, *coords):  # type: ignore[no-untyped-def]
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the write")

    monkeypatch.setattr(store_module, "_write_group", terminated)
    handler_before = signal.getsignal(signal.SIGTERM)
    result = runner.invoke(app, ["grid", str(config), "--out", str(out), "--quiet", "--align-corners"])
    assert result.exit_code == 143, result.output
    assert result.stderr == "error: terminated (SIGTERM); no store was left half-written (writes are atomic)\n"
    assert tree_digest(out / "small.zarr") == before
    assert sorted(p.name for p in out.iterdir()) == ["small.zarr"]
    assert signal.getsignal(signal.SIGTERM) == handler_before


@pytest.mark.parametrize(
    ("out", "phrase"),
    [
        ("small.zarr", "is a zarr store; --out takes the folder that holds stores"),
        ("small.zarr/sub", "is inside the zarr store"),
        ("new.zarr", "is a zarr store; --out takes the folder that holds stores"),
    ],
)
def test_an_out_folder_that_is_or_lies_in_a_store_is_refused(tmp_path: Path, out: str, phrase: str) -> None:
    """`--out artifacts/nuscenes.zarr` must not write a store into the store (which then fails inspect)."""
    from bevcompile.errors import UsageError

    rig = small_rig()
    run_grid(rig, tmp_path)
    before = tree_digest(tmp_path / "small.zarr")
    with pytest.raises(UsageError, match=f"^--out {tmp_path / out} {phrase}"):
        run_grid(rig, tmp_path / out)
    with pytest.raises(UsageError, match=f"^--out {tmp_path / out} {phrase}"):  # every writer of a store
        write_groups(tmp_path / out / "s.zarr", root_attrs=root_attributes(rig), groups={"g": group_data({"x": np.arange(3)})})
    assert tree_digest(tmp_path / "small.zarr") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.zarr"]


def test_an_os_error_while_writing_is_a_store_error_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk or a read-only folder: one StoreError naming the folder, after the cleanup."""
    import errno

    rig = small_rig()
    run_grid(rig, tmp_path)
    before = tree_digest(tmp_path / "small.zarr")
    real = store_module._write_group

    def full_disk(root, name, data, *coords):  # type: ignore[no-untyped-def]
        real(root, name, data, *coords)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_module, "_write_group", full_disk)
    with pytest.raises(StoreError, match=f"^{tmp_path}: cannot write store \\(No space left on device\\)$"):
        run_grid(rig, tmp_path, align_corners=True)
    assert tree_digest(tmp_path / "small.zarr") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.zarr"]
    monkeypatch.undo()

    def read_only(src, dst, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(errno.EROFS, "Read-only file system", str(dst))

    monkeypatch.setattr(store_module.shutil, "copytree", read_only)  # the carry-over copy of a same-config store
    with pytest.raises(StoreError, match=f"^{tmp_path}: cannot write store \\(Read-only file system\\)$"):
        run_grid(rig, tmp_path)
    assert tree_digest(tmp_path / "small.zarr") == before


def test_cleanup_outlasts_a_chunk_write_that_recreates_the_temporary(tmp_path: Path) -> None:
    """After Ctrl-C, a chunk write already inside zarr's worker thread may re-create folders under
    the temporary just after it was removed: the cleanup removes it until it stays gone."""
    import threading
    import time

    tmp = tmp_path / ".s.zarr.tmp-1-host-cafe"
    (tmp / "grid" / "coords" / "c").mkdir(parents=True)
    removed = threading.Event()
    real_rmtree = store_module.shutil.rmtree

    def rmtree(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        real_rmtree(path, *args, **kwargs)
        removed.set()

    def late_chunk_write() -> None:  # zarr's LocalStore._put: mkdir(parents=True), then the file
        removed.wait(5)
        time.sleep(0.02)
        (tmp / "grid" / "coords" / "c" / "0").mkdir(parents=True, exist_ok=True)
        (tmp / "grid" / "coords" / "c" / "0" / "0").write_bytes(b"chunk")

    writer = threading.Thread(target=late_chunk_write)
    writer.start()
    try:
        store_module.shutil.rmtree = rmtree  # type: ignore[assignment]
        store_module._remove_temporary(tmp)
    finally:
        store_module.shutil.rmtree = real_rmtree  # type: ignore[assignment]
        writer.join()
    assert not tmp.exists()


def test_cleanup_cancels_zarr_writes_still_pending_after_an_interrupt() -> None:
    import asyncio

    from zarr.core.sync import _get_loop

    started = asyncio.run_coroutine_threadsafe(asyncio.sleep(60), _get_loop())  # a chunk write zarr still runs
    store_module._cancel_zarr_io(timeout=5)
    assert started.cancelled()


def test_an_interrupt_after_the_store_is_in_place_says_it_was_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while grid summarises (after the swap): the new store is complete and the line says so."""
    import bevcompile.grid.build as build_module
    from bevcompile.cli import app as cli_app

    def interrupted(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    monkeypatch.setattr(build_module, "summarise_cameras", interrupted)
    result = CliRunner().invoke(cli_app, ["grid", "--out", str(tmp_path), "--quiet"])
    assert result.exit_code == 130
    store = tmp_path / "nuscenes.zarr"
    assert result.stderr == f"error: interrupted; {store} was already written completely (its old copy is removed by the next write)\n"
    assert (store / "grid").is_dir()


def test_a_store_folder_this_user_cannot_read_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """stat raises EACCES (not "no such file") in a folder without search permission: inspect
    fails the store (exit 1), verify says so in one line (exit 2), never a traceback."""
    import os

    from bevcompile.cli import app as cli_app

    runner = CliRunner()
    assert runner.invoke(cli_app, ["grid", "--out", str(tmp_path), "--quiet"]).exit_code == 0
    store = tmp_path / "nuscenes.zarr"
    real_lstat = os.lstat

    def lstat(path: str | Path, *args: object, **kwargs: object) -> os.stat_result:
        if Path(path).parent == store:
            raise PermissionError(13, "Permission denied", str(path))
        return real_lstat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(store_module.os, "lstat", lstat)
    result = runner.invoke(cli_app, ["inspect", str(store), "--quiet"])
    assert (result.exit_code == 1 and result.exception is None) or isinstance(result.exception, SystemExit)
    assert f"{store}: /: root_metadata: " in result.stderr and "Permission denied" in result.stderr
    result = runner.invoke(cli_app, ["verify", str(store), "--quiet"])
    assert result.exit_code in (1, 2) and "Traceback" not in result.output
    assert "Permission denied" in result.stderr


def test_a_failed_copy_of_the_kept_groups_is_reported_by_its_strerror() -> None:
    """copytree gathers str(OSError) per file: the message keeps the reason, not errno and paths."""
    import shutil

    error = shutil.Error([("a/c/0", "b/c/0", "[Errno 28] No space left on device: 'a/c/0' -> 'b/c/0'")])
    assert store_module._os_reason(error) == "No space left on device"
    assert store_module._os_reason(OSError(30, "Read-only file system")) == "Read-only file system"


def test_a_store_built_in_a_staging_folder_is_installed_whole(tmp_path: Path) -> None:
    """``staging_folder`` + ``install_store`` (a fleet vehicle): the bytes equal a direct write, an
    existing store of another config is replaced as a whole, nothing is left beside it."""
    first, second = small_rig(), parse_config(small_rig_data(bev_step_m=2.0) | {"name": "small"})
    direct = run_grid(second, tmp_path / "direct").store
    out = tmp_path / "out"
    run_grid(first, out)
    staging = store_module.staging_folder(out / "small.zarr")
    assert staging.parent == out and staging.name.startswith(".small.zarr.tmp-") and not any(staging.iterdir())
    built = run_grid(second, staging).store
    store_module.install_store(built, out / "small.zarr")
    store_module.remove_folder(staging)
    assert tree_digest(out / "small.zarr") == tree_digest(direct)
    assert sorted(p.name for p in out.iterdir()) == ["small.zarr"]
    assert open_store(out / "small.zarr").root_attrs["config_sha256"] == config_sha256(second)


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_install_never_replaces_what_is_not_a_store(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "small.zarr"
    if kind == "file":
        target.write_text("notes")
    else:
        target.mkdir()
        (target / "notes.txt").write_text("keep me")
    staging = store_module.staging_folder(target)
    built = run_grid(small_rig(), staging).store
    with pytest.raises(StoreError, match=r"small\.zarr: exists and is not a store; it is not replaced"):
        store_module.install_store(built, target)
    assert (target.read_text() == "notes") if kind == "file" else (target / "notes.txt").read_text() == "keep me"
    assert built.is_dir()  # the caller removes its staging folder


def test_a_killed_builders_staging_folder_is_removed_by_the_next_one(tmp_path: Path) -> None:
    dead = tmp_path / f".small.zarr.tmp-999999999-{store_module._host_tag()}-deadbeef"
    (dead / "small.zarr").mkdir(parents=True)
    alive = store_module.staging_folder(tmp_path / "small.zarr")
    assert not dead.exists() and alive.is_dir()

# --------------------------------------------------------------------------------------
# one writer per store, the swap readers never see half done, links, consolidated metadata
# --------------------------------------------------------------------------------------


def _tiny(path: Path, group: str, value: int, *, force: bool = False) -> store_module.WriteReport:
    rig = small_rig()
    data = GroupData(arrays={"a": np.full((3, 4), value, dtype=np.int32)}, attrs={"v": value}, dims={"a": ("i", "j")})
    return write_groups(path, root_attrs=root_attributes(rig), groups={group: data}, force=force)


def test_a_second_writer_waits_for_the_lock_then_keeps_the_first_writers_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer that finds the store locked says so once, waits, and then builds on the store
    the first writer left: both groups are there (no lost write), each with its own content."""
    import threading
    import time

    path = tmp_path / "small.zarr"
    messages: list[str] = []
    monkeypatch.setattr(store_module, "LOCK_WAIT_REPORTERS", [messages.append])
    holding, release = threading.Event(), threading.Event()

    def first_writer() -> None:
        with store_module.store_lock(path):
            holding.set()
            release.wait(10)
            _tiny(path, "one", 1)  # re-entrant: the write takes the lock this thread holds

    thread = threading.Thread(target=first_writer)
    thread.start()
    assert holding.wait(10)
    threading.Timer(0.4, release.set).start()
    t0 = time.monotonic()
    _tiny(path, "two", 2)
    thread.join(10)
    assert time.monotonic() - t0 >= 0.3
    assert len(messages) == 1 and messages[0].startswith(f"waiting for {path}: it is being written by pid ")
    reader = open_store(path)
    assert reader.groups() == ["one", "two"]
    assert int(reader.read("one", "a")[0, 0]) == 1 and int(reader.read("two", "a")[0, 0]) == 2
    assert not store_module.lock_path(path).exists()  # the holder removes the lock file on release


def test_a_locked_store_with_waiting_disabled_is_one_line_naming_the_holder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import threading

    path = tmp_path / "small.zarr"
    monkeypatch.setenv(store_module.LOCK_TIMEOUT_ENV, "0")
    holding, release = threading.Event(), threading.Event()

    def holder() -> None:
        with store_module.store_lock(path):
            holding.set()
            release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert holding.wait(10)
        with pytest.raises(store_module.StoreLockedError) as info:
            _tiny(path, "one", 1)
    finally:
        release.set()
        thread.join(10)
    message = str(info.value)
    assert message.startswith(f"{path}: is being written by pid {os.getpid()} on ")
    assert "waiting disabled: BEVCOMPILE_LOCK_TIMEOUT=0" in message and "\n" not in message
    assert not path.exists() and [p.name for p in tmp_path.iterdir()] == []  # nothing written, no temporary


@pytest.mark.parametrize("value", ["-1", "soon", "nan"])
def test_a_bad_lock_timeout_is_a_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    from bevcompile.errors import UsageError

    monkeypatch.setenv(store_module.LOCK_TIMEOUT_ENV, value)
    with pytest.raises(UsageError, match=r"BEVCOMPILE_LOCK_TIMEOUT='.*': expected seconds"):
        _tiny(tmp_path / "small.zarr", "one", 1)


def test_the_lock_of_a_killed_writer_is_released_by_the_os(tmp_path: Path) -> None:
    """A writer killed with SIGKILL while it holds the lock never blocks the next one."""
    import subprocess
    import sys

    path = tmp_path / "small.zarr"
    code = (
        "import os, signal, sys; from bevcompile.store.zarr_io import store_lock\n"
        f"with store_lock({str(path)!r}):\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120, check=False)
    assert result.returncode == -9
    assert store_module.lock_path(path).exists()  # left behind by the kill, but not locked
    store_module.os.environ[store_module.LOCK_TIMEOUT_ENV] = "0"
    try:
        _tiny(path, "one", 1)
    finally:
        del store_module.os.environ[store_module.LOCK_TIMEOUT_ENV]
    assert open_store(path).groups() == ["one"] and not store_module.lock_path(path).exists()


def test_the_swap_exchanges_the_folders_so_the_store_path_never_goes_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "small.zarr"
    _tiny(path, "one", 1)
    seen: list[bool] = []
    real_rename, real_exchange = store_module.os.rename, store_module._exchange

    def rename(src: str | Path, dst: str | Path) -> None:
        seen.append(path.exists())
        real_rename(src, dst)
        seen.append(path.exists())

    def exchange(a: Path, b: Path) -> bool:
        seen.append(path.exists())
        done = real_exchange(a, b)
        seen.append(path.exists())
        return done

    monkeypatch.setattr(store_module.os, "rename", rename)
    monkeypatch.setattr(store_module, "_exchange", exchange)
    _tiny(path, "two", 2)
    assert seen and all(seen)
    assert open_store(path).groups() == ["one", "two"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.zarr"]


def test_a_store_link_is_written_through_and_kept(tmp_path: Path) -> None:
    """A store path that is a symbolic link: the store is rebuilt at its target, the link stays,
    nothing is left beside either."""
    real = tmp_path / "ssd"
    real.mkdir()
    out = tmp_path / "artifacts"
    out.mkdir()
    link = out / "small.zarr"
    link.symlink_to(real / "small.zarr")  # dangling: the first write creates the target
    report = _tiny(link, "one", 1)
    assert report.path == link and report.target == real / "small.zarr"
    _tiny(link, "two", 2)
    assert link.is_symlink() and (real / "small.zarr").is_dir() and not (real / "small.zarr").is_symlink()
    assert open_store(link).groups() == ["one", "two"]
    assert sorted(p.name for p in out.iterdir()) == ["small.zarr"]
    assert sorted(p.name for p in real.iterdir()) == ["small.zarr"]


def test_a_store_link_into_a_missing_folder_and_a_looping_link_are_one_line_errors(tmp_path: Path) -> None:
    link = tmp_path / "small.zarr"
    link.symlink_to(tmp_path / "nowhere" / "small.zarr")
    with pytest.raises(StoreError, match=r"a symbolic link to .*nowhere/small.zarr, whose folder .*nowhere does not exist"):
        _tiny(link, "one", 1)
    link.unlink()
    link.symlink_to(link)
    with pytest.raises(StoreError, match="a symbolic link that cannot be followed"):
        _tiny(link, "one", 1)


def test_a_dangling_out_link_and_a_missing_parent_are_refused_creating_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "gone")
    with pytest.raises(StoreError, match=r"out: a symbolic link to .*gone, which is not a folder"):
        _tiny(out / "small.zarr", "one", 1)
    with pytest.raises(StoreError, match=r"cannot create the output folder: its parent .*/missing does not exist"):
        _tiny(tmp_path / "missing" / "out" / "small.zarr", "one", 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    _tiny(tmp_path / "new" / "small.zarr", "one", 1)  # the one folder --out names is created
    assert (tmp_path / "new" / "small.zarr").is_dir()


def test_an_old_link_a_previous_version_moved_aside_is_removed(tmp_path: Path) -> None:
    path = tmp_path / "small.zarr"
    _tiny(path, "one", 1)
    stale = tmp_path / f".small.zarr{store_module.OLD_MARK}999999999-{store_module._host_tag()}-deadbeef"
    stale.symlink_to(tmp_path / "elsewhere")
    _tiny(path, "two", 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.zarr"]


def test_writes_into_a_consolidated_store_rebuild_its_consolidated_metadata(tmp_path: Path) -> None:
    """After ``zarr.consolidate_metadata`` a later write keeps the store consistent for both
    kinds of reader: the per-node metadata and the consolidated copy both list the new group."""
    import zarr

    path = tmp_path / "small.zarr"
    _tiny(path, "one", 1)
    with pytest.warns(UserWarning, match="Consolidated metadata"):
        zarr.consolidate_metadata(str(path))
    report = _tiny(path, "two", 2)
    assert report.consolidated
    consolidated = zarr.open_consolidated(str(path), zarr_format=3)
    assert sorted(consolidated.group_keys()) == ["one", "two"]
    assert int(consolidated["two"]["a"][0, 0]) == 2
    assert open_store(path).groups() == ["one", "two"]
    # every write consolidates: a new store's consolidated copy lists its groups too (the report's
    # ``consolidated`` says a user's existing copy was rebuilt)
    plain = tmp_path / "plain.zarr"
    assert not _tiny(plain, "one", 1).consolidated
    assert sorted(zarr.open_consolidated(str(plain), zarr_format=3).group_keys()) == ["one"]


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "huge"])
def test_a_metadata_file_that_is_no_regular_file_is_refused_unread(tmp_path: Path, kind: str) -> None:
    import os

    path = tmp_path / "small.zarr"
    _tiny(path, "one", 1)
    meta = path / "one" / "a" / "zarr.json"
    meta.unlink()
    if kind == "fifo":
        os.mkfifo(meta)
    elif kind == "dev_zero":
        meta.symlink_to("/dev/zero")
    else:
        with open(meta, "wb") as fh:
            fh.truncate(store_module.MAX_METADATA_BYTES + 1)
    reason = {"fifo": "a FIFO, not a regular file", "dev_zero": "a character device, not a regular file", "huge": "more than the 64 MiB"}[kind]
    with pytest.raises(StoreError, match=reason):
        open_store(path).read("one", "a")


def test_a_chunk_that_is_a_fifo_is_refused_before_zarr_reads_it(tmp_path: Path) -> None:
    import os

    path = tmp_path / "small.zarr"
    _tiny(path, "one", 1)
    chunk = next(p for p in (path / "one" / "a" / "c").rglob("*") if p.is_file())
    chunk.unlink()
    os.mkfifo(chunk)
    with pytest.raises(StoreError, match=r"one/a: c/0/0: a FIFO, not a regular file"):
        open_store(path).read("one", "a")


def test_inspect_fails_stale_consolidated_metadata_and_passes_fresh(tmp_path: Path) -> None:
    import warnings

    import zarr

    from bevcompile.store.inspection import inspect_store

    path = tmp_path / "small.zarr"
    _tiny(path, "one", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(path))
    check = next(c for c in inspect_store(path).checks if c.name == "consolidated_metadata")
    assert check.passed
    # a write by a tool that does not re-consolidate (here: by hand) leaves the copy stale
    root = zarr.open_group(str(path), mode="r+", zarr_format=3, use_consolidated=False)
    root["one"].attrs["v"] = 5
    check = next(c for c in inspect_store(path).checks if c.name == "consolidated_metadata")
    assert not check.passed and "one differs from its zarr.json" in check.reason


@pytest.fixture(scope="module")
def every_group_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small store holding every group and every optional array the commands write."""
    from bevcompile.cli import app as cli_app

    from ..rigs import write_yaml

    out = tmp_path_factory.mktemp("every_group")
    config = write_yaml(out / "small.yaml", small_rig_data(heights=(0.0, 1.0)))
    runner = CliRunner()
    for args in (
        ["grid", str(config), "--out", str(out), "--align", "30", "--order", "cache",
         *(a for f in ("opencv", "pixel_q", "norm_q16", "uq12") for a in ("--format", f))],
        ["matrix", str(config), "--out", str(out), "--topk", "8", "--tile-rows", "16", "--quantize", "int8", "--compact-rows"],
        ["export-interop", str(out / "small.zarr"), "--to", "bevpoolv2", "--to", "fastbev-lut"],
    ):
        result = runner.invoke(cli_app, [*args, "--quiet"])
        assert result.exit_code == 0, result.output
    return out / "small.zarr"


def test_xarray_opens_every_group_and_reads_what_zarr_reads(every_group_store: Path) -> None:
    """Other people's readers: every array carries ``dimension_names``, so xarray opens every
    group as a Dataset (one length per dimension name) and reads the same dtype and bytes; every
    named axis with a meaning has a coordinate (camera names, x / y cell centres and heights in
    metres of the BEV frame), so ``sel`` works; and the default open (consolidated metadata) is
    silent."""
    import warnings

    import xarray as xr
    import zarr

    from bevcompile.store.coords import coordinate_values

    root = zarr.open_group(str(every_group_store), mode="r", zarr_format=3, use_consolidated=False)
    reader = open_store(every_group_store)
    values = coordinate_values(small_rig(heights=(0.0, 1.0)))
    groups = sorted(root.group_keys())
    assert groups == ["delta", "gather", "grid", "interop", "matrix"]
    n_arrays = 0
    coordinates: dict[str, list[str]] = {}
    for group in groups:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "Failed to open Zarr store with consolidated metadata"
            dataset = xr.open_zarr(str(every_group_store), group=group)
        names = sorted(reader.arrays(group))
        assert sorted(dataset.data_vars) == names, group
        coordinates[group] = sorted(dataset.coords)
        assert sorted(reader.coordinates(group)) == coordinates[group], group
        for name in coordinates[group]:
            got = dataset[name].values
            assert [str(v) for v in got.tolist()] == [str(v) for v in values[name].tolist()], f"{group}/{name}"
        for name in names:
            stored = root[group][name]  # type: ignore[index]
            assert tuple(dataset[name].dims) == tuple(stored.metadata.dimension_names), f"{group}/{name}"
            got = dataset[name].values
            expected = stored[...]
            assert got.dtype == expected.dtype and np.array_equal(got, expected), f"{group}/{name}"
            n_arrays += 1
    assert n_arrays == 45
    assert coordinates == {
        "delta": ["camera", "height"],
        "gather": [],  # --order cache: the flat (row, corner) layout has no named BEV axis
        "grid": ["camera", "height", "x", "y"],
        "interop": ["height", "x", "y"],
        "matrix": ["camera", "x", "y"],
    }
    assert tuple(root["grid"]["coords"].metadata.dimension_names) == ("camera", "height", "y", "x", "uv")  # type: ignore[index]
    grid = xr.open_zarr(str(every_group_store), group="grid")
    front = grid.sel(camera=str(values["camera"][0]), x=float(values["x"][3]), y=float(values["y"][5]), height=1.0)
    assert np.array_equal(front["coords"].values, root["grid"]["coords"][0, 1, 5, 3])  # type: ignore[index]


def test_every_metadata_file_is_strict_json_and_every_group_names_its_config(every_group_store: Path) -> None:
    """tensorstore-style strictness: no NaN/Infinity anywhere in the metadata; every group
    records the root's config_sha256."""
    import json

    def refuse(token: str) -> None:
        raise ValueError(f"non-standard JSON constant {token}")

    files = sorted(every_group_store.rglob("zarr.json"))
    assert len(files) == 1 + 5 + 45 + 2 + 4 + 3 + 3  # root, groups, arrays, coordinates
    for meta in files:
        json.loads(meta.read_text(), parse_constant=refuse)
    root_sha = open_store(every_group_store).root_attrs["config_sha256"]
    reader = open_store(every_group_store)
    assert {g: reader.group_attrs(g)["config_sha256"] for g in reader.groups()} == dict.fromkeys(reader.groups(), root_sha)


def test_dimension_names_must_name_every_axis_once_per_length(tmp_path: Path) -> None:
    rig = small_rig()
    bad = GroupData(arrays={"a": np.zeros((2, 3)), "b": np.zeros(4)}, dims={"a": ("row", "col"), "b": ("row",)})
    with pytest.raises(StoreError, match=r"one/b: dimension 'row' has length 4, 2 in one/a"):
        write_groups(tmp_path / "small.zarr", root_attrs=root_attributes(rig), groups={"one": bad})
    missing = GroupData(arrays={"a": np.zeros((2, 3))})
    with pytest.raises(StoreError, match=r"one/a: dimension names None do not name its 2 axes"):
        write_groups(tmp_path / "small.zarr", root_attrs=root_attributes(rig), groups={"one": missing})
    assert not (tmp_path / "small.zarr").exists()
