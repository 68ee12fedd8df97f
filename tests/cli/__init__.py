import re


def flat(text: str) -> str:
    """``text`` with every run of whitespace (table wrapping, line breaks) as one space."""
    return " ".join(text.split())


def table_words(text: str) -> str:
    """A rich table's text with its box-drawing characters (U+2500-U+257F) and every run of
    whitespace as one space: ``"│nnz │ 42│"`` -> ``"nnz 42"``."""
    return " ".join(re.sub(r"[\u2500-\u257f]", " ", text).split())


def assert_strict_and_verify_pass(store: object) -> str:
    """``bevcompile inspect STORE --strict`` and ``bevcompile verify STORE`` both exit 0; verify's output."""
    from typer.testing import CliRunner

    from bevcompile.cli import app

    runner = CliRunner()
    strict = runner.invoke(app, ["inspect", str(store), "--strict"])
    assert strict.exit_code == 0, strict.output
    assert "checks passed" in strict.output
    verify = runner.invoke(app, ["verify", str(store)])
    assert verify.exit_code == 0, verify.output
    return verify.output
