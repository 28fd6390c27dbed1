"""The client commands as an operator meets them: ``expeditor inspect``'s table shows
the ids clients chose as they are (rich markup in an id is not applied, nor fails the
table; control characters are written as escapes instead of reaching the terminal), and
bad options or an absent server give one error line, not a traceback."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from expeditor.cli import app  # the command modules load through it
from expeditor.cli_client import plain


@pytest.mark.parametrize(
    ("chosen", "shown"),
    [
        ("[/]", "[/]"),  # made the whole table fail (MarkupError)
        ("[bold red]pwn[/bold red]", "[bold red]pwn[/bold red]"),
        ("[link=http://x]y[/link]", "[link=http://x]y[/link]"),
        ("\x1b[31mred\x07", "\\x1b[31mred\\x07"),
        ("req-1/0", "req-1/0"),
    ],
)
def test_client_chosen_ids_are_shown_as_they_are(chosen: str, shown: str) -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system="truecolor", width=200)
    console.print(plain(chosen))
    assert out.getvalue() == shown + "\n"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["inspect", "--timeout", "0"], "--timeout must be a positive"),
        (["inspect", "--timeout", "nan"], "--timeout must be a positive"),
        (["inspect", "--watch", "nan"], "--watch must be a positive"),
        (["generate", "--token-ids", "1,,2"], "expected comma-separated integers"),
        (["generate", "--token-ids", "99999999999999999999999"], "cannot be sent"),
        (["generate", "hi", "--priority", "99999999999999999999999"], "cannot be sent"),
        (["inspect", "--timeout", "0.5"], "running?"),  # nobody there
        (["generate", "hi", "--timeout", "0.5"], "running?"),
        (["cleanup-shm", "--shm-dir", "{tmp}/none"], "is not a directory"),
        (["cleanup-shm", "--shm-dir", "{tmp}/file"], "is not a directory"),
    ],
)
def test_the_client_commands_fail_in_one_line(args: list[str], words: str, tmp_path: Path) -> None:
    """Bad options and an absent server: one error line naming the problem, exit 1 or
    2, no traceback."""
    (tmp_path / "file").write_text("")
    args = [arg.format(tmp=tmp_path) for arg in args]
    if args[0] != "cleanup-shm":
        args += ["--address", f"ipc://{tmp_path}/nobody.sock"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code in (1, 2), result.output
    assert words in " ".join(result.output.split()) and "Traceback" not in result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)
