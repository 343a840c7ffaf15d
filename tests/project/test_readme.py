"""Every fenced code block of README.md runs as written or is checked.

- ```python blocks run as written, each in a fresh interpreter on the CPU, in an empty
  working directory.
- ```bash blocks are split into commands; each command is checked by the checker of its
  program (`COMMAND_CHECKERS`): `bam-train` commands must resolve to a valid configuration
  (preset, `--config.FIELD=VALUE` overrides and flags), and the cheap one that asks for
  `--dry-run` runs it; `bam-eval` and `bam-quickstart` arguments must parse; `pip` extras,
  `pytest` paths and markers must exist. A program without a checker fails the test, so a
  new kind of command needs one here.
- ```bibtex blocks must be one balanced entry citing the paper.

Commands that take hours or hardware (the quick start, paper presets, pods) are only
resolved, never run. `pytest -m slow` also dry-runs every cheap `bam-train` command.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import REPO_ROOT

REPO = REPO_ROOT
README = REPO / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.DOTALL | re.MULTILINE)
# Characters that separate commands (";", "&&", "||", "|", "&", line ends); shlex returns a
# run of them (say "\n\n") as one token.
COMMAND_SEPARATOR_CHARS = ";&|\n"
# Programs the README may call whose behaviour this repository does not define.
EXTERNAL_PROGRAMS = {"gcsfuse"}
# Training presets small enough to dry-run (build and compile) in a test.
CHEAP_TRAIN_PRESETS = {"tiny", "micro"}
PYTHON_BLOCK_TIMEOUT_S = 300
PAPER_ARXIV_ID = "2505.22842"


@dataclasses.dataclass(frozen=True)
class CodeBlock:
    language: str
    text: str
    line: int

    @property
    def name(self) -> str:
        return f"README.md:{self.line}:{self.language or 'plain'}"


def readme_blocks() -> list[CodeBlock]:
    text = README.read_text(encoding="utf-8")
    return [
        CodeBlock(match.group(1), match.group(2), text.count("\n", 0, match.start()) + 1)
        for match in FENCE.finditer(text)
    ]


def blocks_of(language: str) -> list[CodeBlock]:
    return [block for block in readme_blocks() if block.language == language]


def shell_commands(script: str) -> list[list[str]]:
    """The simple commands of a shell script: comments dropped, continuation lines joined,
    split at ;, &&, ||, | and & and at line ends."""
    script = script.replace("\\\n", " ")
    script = "\n".join(re.sub(r"(^|\s)#.*$", "", line) for line in script.splitlines())
    lexer = shlex.shlex(script, posix=True, punctuation_chars=COMMAND_SEPARATOR_CHARS)
    lexer.whitespace = " \t\r"
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if set(token) <= set(COMMAND_SEPARATOR_CHARS):
            commands.append([])
        else:
            commands[-1].append(token)
    return [command for command in commands if command]


def readme_commands() -> list[list[str]]:
    """Every command of every bash block, with the commands nested in `gcloud ... --command`."""
    commands = []
    for block in blocks_of("bash"):
        for command in shell_commands(block.text):
            commands.append(command)
            commands += [
                nested for script in nested_scripts(command) for nested in shell_commands(script)
            ]
    return commands


def nested_scripts(command: list[str]) -> list[str]:
    if command[0] != "gcloud":
        return []
    return [arg.split("=", 1)[1] for arg in command if arg.startswith("--command=")]


def flag_value(args: list[str], name: str) -> str | None:
    """The value of `--name=VALUE` or `--name VALUE` in args, the last one given."""
    value = None
    for i, arg in enumerate(args):
        if arg.startswith(f"{name}="):
            value = arg.split("=", 1)[1]
        elif arg == name and i + 1 < len(args):
            value = args[i + 1]
    return value


# One checker per program; each takes the arguments after the program name.


def resolve_train_command(args: list[str]):
    """The validated TrainConfig of a bam-train command line (preset, overrides, flags)."""
    from bam_train.cli import parse_args

    config, _ = parse_args(["bam-train", *args])
    return config


def dry_run_train_command(args: list[str], workdir: Path) -> None:
    """`bam-train ARGS --dry-run`, run in `workdir`: data, mesh, compiled steps, memory."""
    from bam_train.cli import run

    dry_run_args = args if "--dry-run" in args else [*args, "--dry-run"]
    previous = Path.cwd()
    os.chdir(workdir)
    try:
        status = run(["bam-train", *dry_run_args])
    finally:
        os.chdir(previous)
    assert status == 0, f"bam-train {shlex.join(dry_run_args)} exited with {status}"


def is_cheap_train_command(args: list[str]) -> bool:
    return flag_value(args, "--config") in CHEAP_TRAIN_PRESETS


def check_bam_train(args: list[str]) -> None:
    if args in (["--help"], ["-h"]):
        return
    resolve_train_command(args)


def check_bam_eval(args: list[str]) -> None:
    from bam_eval.cli import build_parser

    build_parser().parse_args(args)


def check_bam_quickstart(args: list[str]) -> None:
    import bam_jax
    from bam_configs.presets import preset
    from bam_quickstart.run import build_parser

    parsed = build_parser().parse_args(args)
    preset(parsed.preset)
    encodings = [e.strip() for e in parsed.encodings.split(",") if e.strip()]
    assert set(encodings) <= set(bam_jax.ENCODINGS), encodings


def check_pip(args: list[str]) -> None:
    constraints = flag_value(args, "-c")
    if constraints is not None:
        assert (REPO / constraints).is_file(), f"pip: no constraints file {constraints}"
        at = args.index("-c")
        args = args[:at] + args[at + 2 :]
    assert args[:2] == ["install", "-e"], f"expected `pip install -e ...`, got {args}"
    target = args[2]
    extras = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", target)
    assert extras, f"pip installs {target!r}, not this repository"
    with open(REPO / "pyproject.toml", "rb") as f:
        declared = tomllib.load(f)["project"]["optional-dependencies"]
    wanted = extras.group(1).split(",") if extras.group(1) else []
    assert set(wanted) <= set(declared), f"unknown extras {wanted}; pyproject has {declared}"


def check_pytest(args: list[str]) -> None:
    with open(REPO / "pyproject.toml", "rb") as f:
        markers = tomllib.load(f)["tool"]["pytest"]["ini_options"]["markers"]
    marker_names = {m.split(":")[0] for m in markers}
    marker = flag_value(args, "-m")
    if marker is not None:
        assert set(re.findall(r"\w+", marker)) - {"not", "and", "or"} <= marker_names
    paths = [arg for arg in args if not arg.startswith("-") and arg != marker]
    for path in paths:
        assert (REPO / path.split("::")[0]).exists(), f"pytest: no such path {path}"


def check_python(args: list[str]) -> None:
    import importlib.util

    if args[0] == "-m":
        assert importlib.util.find_spec(args[1]) is not None, f"no module {args[1]}"
    else:
        assert (REPO / args[0]).is_file(), f"no script {args[0]}"


def check_gcloud(args: list[str]) -> None:
    assert flag_value(args, "--command"), "a gcloud command in the README runs a --command"


COMMAND_CHECKERS: dict[str, Callable[[list[str]], None]] = {
    "bam-train": check_bam_train,
    "bam-eval": check_bam_eval,
    "bam-quickstart": check_bam_quickstart,
    "pip": check_pip,
    "pytest": check_pytest,
    "python": check_python,
    "gcloud": check_gcloud,
}


def check_command(command: list[str]) -> None:
    program, args = command[0], command[1:]
    if program in EXTERNAL_PROGRAMS:
        return
    assert program in COMMAND_CHECKERS, f"no checker for `{shlex.join(command)}`"
    try:
        COMMAND_CHECKERS[program](args)
    except SystemExit as error:
        raise AssertionError(f"`{shlex.join(command)}` exits with {error.code}") from None


def test_every_block_has_a_checked_language():
    languages = {block.language for block in readme_blocks()}
    assert languages <= {"python", "bash", "bibtex"}, languages


def test_shell_commands_are_split_as_a_shell_would():
    script = "pip install -e . && bam-quickstart   # comment\n\nbam-train --a=1 \\\n  --b='x y'\n"
    assert shell_commands(script) == [
        ["pip", "install", "-e", "."],
        ["bam-quickstart"],
        ["bam-train", "--a=1", "--b=x y"],
    ]


def test_set_up_is_the_two_commands():
    (set_up, *_) = blocks_of("bash")
    assert shell_commands(set_up.text) == [
        ["pip", "install", "-e", ".[all]"],
        ["bam-quickstart"],
        ["pip", "install", "-e", ".[test]"],
        ["pytest"],
    ]


@pytest.mark.parametrize("command", readme_commands(), ids=shlex.join)
def test_command(command: list[str]):
    check_command(command)


def test_dry_run_command_runs(tmp_path):
    """The README's `--dry-run` commands of cheap presets run as written."""
    commands = [c[1:] for c in readme_commands() if c[0] == "bam-train" and "--dry-run" in c]
    assert commands, "the README shows a bam-train --dry-run"
    for args in commands:
        if is_cheap_train_command(args):
            dry_run_train_command(args, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [c[1:] for c in readme_commands() if c[0] == "bam-train" and is_cheap_train_command(c[1:])],
    ids=shlex.join,
)
def test_cheap_train_command_dry_runs(args: list[str], tmp_path):
    dry_run_train_command(args, tmp_path)


@pytest.mark.parametrize("block", blocks_of("python"), ids=lambda b: b.name)
def test_python_block_runs(block: CodeBlock, tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", block.text],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=PYTHON_BLOCK_TIMEOUT_S,
    )
    assert result.returncode == 0, f"{block.name} failed:\n{result.stderr[-4000:]}"


@pytest.mark.parametrize("block", blocks_of("bibtex"), ids=lambda b: b.name)
def test_bibtex_block_cites_the_paper(block: CodeBlock):
    text = block.text.strip()
    assert re.match(r"@\w+\{\w+,", text), text[:40]
    depth = 0
    for char in text:
        depth += {"{": 1, "}": -1}.get(char, 0)
        assert depth >= 0, "unbalanced braces"
    assert depth == 0, "unbalanced braces"
    assert PAPER_ARXIV_ID in text
