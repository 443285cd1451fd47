"""How the CLI tests read a refusal: one line on stderr, never a traceback."""


def one_line(err: str) -> str:
    """The one non-blank line of `err`; fails the test on more, or on a traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]
