

def flat(text: str) -> str:
    """``text`` with every run of whitespace (table wrapping, line breaks) as one space."""
    return " ".join(text.split())
