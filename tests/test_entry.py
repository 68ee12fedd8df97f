"""The console entry point (``bevcompile._entry``) and the lazy package namespace."""

from __future__ import annotations

import importlib.abc
import subprocess
import sys
from typing import Any

import pytest

from bevcompile import _entry


class _DuringTheCliImport(importlib.abc.MetaPathFinder):
    """Runs ``act`` while ``bevcompile.cli`` (numpy, zarr, rich, the commands) is being imported."""

    def __init__(self, act: Any) -> None:
        self.act = act

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname == "bevcompile.cli":
            self.act()
        return None


def _interrupt() -> None:
    raise KeyboardInterrupt


def _terminate() -> None:
    import os
    import signal

    os.kill(os.getpid(), signal.SIGTERM)


@pytest.fixture
def signals_restored() -> Any:
    """The entry point installs handlers (and ignores both signals on the way out): undo it."""
    import signal

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@pytest.mark.parametrize(
    ("act", "code", "line"),
    [
        (_interrupt, 130, "error: interrupted while starting; nothing was written"),
        # issue 31: a SIGTERM before the CLI's handler was installed killed the process without a word
        (_terminate, 143, "error: terminated (SIGTERM) while starting; nothing was written"),
    ],
)
def test_a_signal_while_the_cli_loads_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], signals_restored: None, act: Any, code: int, line: str
) -> None:
    monkeypatch.delitem(sys.modules, "bevcompile.cli", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_DuringTheCliImport(act), *sys.meta_path])
    with pytest.raises(SystemExit) as info:
        _entry.main(["grid", "--help"])
    assert info.value.code == code
    assert capsys.readouterr().err == f"{line}\n"


def test_entry_point_runs_the_cli(capsys: pytest.CaptureFixture[str], signals_restored: None) -> None:
    with pytest.raises(SystemExit) as info:
        _entry.main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("bevcompile ")


def test_import_bevcompile_is_light_and_names_resolve_lazily() -> None:
    """``import bevcompile`` loads no numpy (the entry point must catch a Ctrl-C during that
    import); the public names still resolve, and an unknown one is an AttributeError."""
    code = (
        "import sys, bevcompile; assert 'numpy' not in sys.modules, 'numpy imported eagerly'; "
        "from bevcompile import load, UsageError, run_grid; assert issubclass(UsageError, ValueError); "
        "import bevcompile as b; assert set(b.__all__) <= set(dir(b)); "
        "exec('try:\\n b.nope\\nexcept AttributeError as e:\\n print(e)')"
    )
    assert _python_stdout(code) == "module 'bevcompile' has no attribute 'nope'\n"


def test_submodules_resolve_after_a_bare_import() -> None:
    """``import bevcompile; bevcompile.delta.decode_delta`` (as the README writes it) works with
    the lazy namespace: a submodule loads on first attribute access; private names do not."""
    code = (
        "import bevcompile; f = bevcompile.delta.decode_delta; "
        "import bevcompile.delta as d; assert f is d.decode_delta; "
        "assert bevcompile.store.STORE_FORMAT; "
        "exec('try:\\n bevcompile._nope\\nexcept AttributeError as e:\\n print(e)')"
    )
    assert _python_stdout(code) == "module 'bevcompile' has no attribute '_nope'\n"


def _python_stdout(code: str) -> str:
    """stdout of ``python -c code`` in a fresh interpreter (asserting it exits 0)."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout
