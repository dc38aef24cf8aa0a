"""Every ``verl-engine`` and ``verl-config`` command written in a shell block of the README files and the docs
parses as written, and its verl overrides load.

Why: these lines are what a new user copies first; a renamed flag or a key verl no longer accepts would make the
first command they try fail. Commands are not run (a GRPO run takes minutes): ``verl-config`` commands are (they
take a second, no torch), ``verl-engine`` ones go through the command's own argument parser and their
``key=value`` overrides through verl-config with the defaults the command adds. A template token such as
``--preset tiny|small|base|1b`` is checked with its first choice. Other shell lines (pip, uv, nox, torchrun's
own flags) are install and tooling steps, not checked here.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *ROOT.glob("packages/*/README.md"), *ROOT.glob("docs/**/*.md")])
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)[^\n]*\n(.*?)^```", flags=re.S | re.M)
TOOLS = ("verl-engine", "verl-config")


def _lines(text: str) -> list[str]:
    """The block's command lines: continuations joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line.split(" #", 1)[0].strip() for line in joined.splitlines() if line.strip()]


def commands() -> list[tuple[str, str, list[str]]]:
    """(where, tool, argv) of every documented command of our two tools."""
    found = []
    for doc in DOCS:
        for block in SHELL_BLOCK.findall(doc.read_text()):
            for line in _lines(block):
                words = shlex.split(line)
                if words[:2] == ["uv", "run"]:
                    words = words[2:]
                if words[:1] == ["torchrun"] and "-m" in words:  # torchrun [its flags] -m verl_engine ...
                    module = words.index("-m") + 1
                    words = ["verl-engine", *words[module + 1 :]] if words[module] == "verl_engine" else []
                if words[:1] and words[0] in TOOLS:
                    argv = [
                        w.split("|", 1)[0] if "|" in w and not w.startswith("--") else w for w in words[1:]
                    ]
                    found.append((f"{doc.relative_to(ROOT)}: {line}", words[0], argv))
    return found


COMMANDS = commands()


def test_the_docs_show_commands_of_both_tools() -> None:
    assert {tool for _, tool, _ in COMMANDS} == set(TOOLS)
    assert len(COMMANDS) >= 15


@pytest.mark.parametrize(("where", "tool", "argv"), COMMANDS, ids=[c[0][:90] for c in COMMANDS])
def test_a_documented_command_parses_and_its_overrides_load(where: str, tool: str, argv: list[str]) -> None:
    if tool == "verl-config":
        from verl_config.cli import main

        with contextlib.redirect_stdout(io.StringIO()):
            assert main(argv) == 0, where
        return
    from verl_config import load_config
    from verl_engine.apps.cli import _parse, parse_train_args

    if argv[0] == "train":
        parse_train_args(argv)  # flags and overrides into a validated SFTConfig
        return
    args = _parse(argv)
    assert args.command == "grpo", where
    from verl_engine.apps.grpo_run import _DEFAULTS

    load_config(overrides=[*_DEFAULTS, *args.overrides])
