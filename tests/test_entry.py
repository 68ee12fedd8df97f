"""The console entry point (``bevcompile._entry``) and the lazy package namespace."""

from __future__ import annotations

import importlib.abc
import subprocess
import sys
from typing import Any

import pytest

from bevcompile import _entry


class _InterruptingFinder(importlib.abc.MetaPathFinder):
    """Ctrl-C while ``bevcompile.cli`` (numpy, zarr, rich, the commands) is being imported."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname == "bevcompile.cli":
            raise KeyboardInterrupt
        return None


def test_ctrl_c_while_the_cli_loads_is_one_line_and_exit_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], signals_restored: None
) -> None:
    monkeypatch.delitem(sys.modules, "bevcompile.cli", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_InterruptingFinder(), *sys.meta_path])
    with pytest.raises(SystemExit) as info:
        _entry.main(["grid", "--help"])
    assert info.value.code == 130
    assert capsys.readouterr().err == "error: interrupted while starting; nothing was written\n"


class _TerminatingFinder(importlib.abc.MetaPathFinder):
    """SIGTERM while ``bevcompile.cli`` is being imported (before the CLI's handler exists)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname == "bevcompile.cli":
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)
        return None


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


def test_sigterm_while_the_cli_loads_is_one_line_and_exit_143(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], signals_restored: None
) -> None:
    """issue 31: a SIGTERM before the CLI's handler was installed killed the process without a word."""
    monkeypatch.delitem(sys.modules, "bevcompile.cli", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_TerminatingFinder(), *sys.meta_path])
    with pytest.raises(SystemExit) as info:
        _entry.main(["grid", "--help"])
    assert info.value.code == 143
    assert capfd.readouterr().err == "error: terminated (SIGTERM) while starting; nothing was written\n"


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
