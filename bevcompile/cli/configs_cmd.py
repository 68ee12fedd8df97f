"""``bevcompile configs``: the example rig configs bundled in the package (the files of the
repository's ``configs/``), listed, or copied out so the README's ``configs/...`` commands run from
an installed wheel without a clone."""

from __future__ import annotations

import os
import uuid
from importlib import resources
from pathlib import Path
from typing import Annotated

import typer

from ..errors import UsageError
from ._app import cli_command
from ._options import ForceOption, JsonOption, QuietOption
from ._output import new_table, print_json, print_table, stdout_console


def bundled_configs() -> dict[str, bytes]:
    """Relative path (``nuscenes.yaml``, ``fleet/example.yaml``) -> bytes of every bundled config."""
    root = resources.files("bevcompile").joinpath("data", "configs")
    out: dict[str, bytes] = {}

    def walk(node: resources.abc.Traversable, prefix: str) -> None:
        for child in sorted(node.iterdir(), key=lambda c: c.name):
            if child.is_dir():
                walk(child, f"{prefix}{child.name}/")
            elif child.name.endswith(".yaml"):
                out[f"{prefix}{child.name}"] = child.read_bytes()

    if root.is_dir():
        walk(root, "")
    return out


def _description(text: bytes) -> str:
    """The first comment line of a config (what it is), or its ``name:``."""
    for line in text.decode("utf-8", "replace").splitlines():
        stripped = line.strip()
        if stripped.startswith("#") and stripped.strip("# "):
            return stripped.lstrip("# ").strip()
    return ""


def copy_configs(files: dict[str, bytes], target: Path, *, force: bool) -> tuple[list[str], list[str]]:
    """Write ``files`` below ``target`` (created), each atomically; ``(copied, identical)``.
    A different existing file is refused (:class:`UsageError`, nothing written) unless ``force``."""
    if target.exists() and not target.is_dir():
        raise UsageError(f"{target}: exists and is not a folder")
    different = [name for name, data in files.items() if (target / name).is_file() and (target / name).read_bytes() != data]
    if different and not force:
        raise UsageError(f"{target / different[0]}: exists and differs from the bundled config ({len(different)} such file(s)); --force replaces them")
    copied, identical = [], []
    for name, data in files.items():
        path = target / name
        if path.is_file() and path.read_bytes() == data:
            identical.append(name)
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as exc:
            raise UsageError(f"{path}: cannot write ({exc.strerror or exc})") from None
        copied.append(name)
    return copied, identical


@cli_command("configs", writes="file", short_help="The example rig configs bundled in the package: list them, or copy them out (--copy DIR).")
def configs(
    copy: Annotated[
        Path | None,
        typer.Option("--copy", metavar="DIR", help="Copy every bundled config into DIR (fleet/ kept as a sub-folder), e.g. --copy configs.", show_default=False),
    ] = None,
    force: ForceOption = False,
    quiet: QuietOption = False,
    json_output: JsonOption = False,
) -> None:
    """List the example rig configs that ship inside the package (the repository's configs/), or
    copy them into a folder so that the README's `configs/...` commands run from an installed wheel."""
    files = bundled_configs()
    if not files:
        raise UsageError("this installation has no bundled configs (bevcompile/data/configs is missing)")
    if copy is None:
        if json_output:
            print_json([{"file": name, "description": _description(data)} for name, data in files.items()])
            return
        table = new_table("bundled configs (bevcompile configs --copy DIR writes them into DIR)", "file", "what it is", right=())
        for name, data in files.items():
            table.add_row(name, _description(data))
        print_table(table)
        return
    copied, identical = copy_configs(files, copy, force=force)
    if json_output:
        print_json({"folder": str(copy), "copied": copied, "identical": identical})
    elif not quiet:
        stdout_console.print(f"{copy}: {len(copied)} config(s) copied, {len(identical)} already there and identical", markup=False, highlight=False)
