import re


def flat(text: str) -> str:
    """``text`` with every run of whitespace (table wrapping, line breaks) as one space."""
    return " ".join(text.split())


def table_words(text: str) -> str:
    """A rich table's text with its box-drawing characters (U+2500-U+257F) and every run of
    whitespace as one space: ``"│nnz │ 42│"`` -> ``"nnz 42"``."""
    return " ".join(re.sub(r"[\u2500-\u257f]", " ", text).split())
