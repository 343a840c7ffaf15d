"""What the distribution installs: import names that cannot shadow a user's packages, the
dependencies each part imports, and the console scripts' check of their extras.

The folders train/, eval/, configs/ and quickstart/ install as bam_train, bam_eval,
bam_configs and bam_quickstart (pyproject.toml's package-dir).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import bam_jax
from bam_eval import entry as eval_entry
from bam_jax import extras
from bam_quickstart import entry as quickstart_entry
from bam_train import entry as train_entry
from tests.support import REPO_ROOT

ROOT = REPO_ROOT
with open(ROOT / "pyproject.toml", "rb") as _f:
    PYPROJECT = tomllib.load(_f)
PROJECT = PYPROJECT["project"]
PACKAGE_DIR = PYPROJECT["tool"]["setuptools"]["package-dir"]
FOLDERS = {"bam_jax": "bam_jax"} | {folder: name for name, folder in PACKAGE_DIR.items()}
# Extras whose packages a default test run may import (torch tests skip without torch).
TEST_EXTRAS = ("train", "eval", "plots", "hf", "test", "torch")
# Import names that no installed distribution reports (optional, absent here).
UNINSTALLED_IMPORTS = {"torch": "torch"}


def requirement_names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def extra_names(*names: str) -> set[str]:
    """Distributions of the given extras, following the extras that name bam-jax itself."""
    declared = set()
    for name in names:
        for requirement in map(Requirement, PROJECT["optional-dependencies"][name]):
            if canonicalize_name(requirement.name) == "bam-jax":
                declared |= extra_names(*requirement.extras)
            else:
                declared.add(canonicalize_name(requirement.name))
    return declared


def third_party_imports(folder: str) -> set[str]:
    """Top-level names of every module the folder's files import (also in functions) that is
    neither the standard library nor part of the repository."""
    local = set(FOLDERS.values()) | {"tests", "bench"}
    names = set()
    for path in (ROOT / folder).rglob("*.py"):
        names |= imported_names(path.read_text(encoding="utf-8"))
    return {name for name in names if name not in sys.stdlib_module_names} - local - {"__future__"}


def distributions_of(import_names: set[str]) -> set[str]:
    providers = importlib.metadata.packages_distributions()
    found = set()
    for name in import_names:
        dists = providers.get(name) or [UNINSTALLED_IMPORTS.get(name)]
        assert dists != [None], f"no installed distribution provides the module {name!r}"
        found |= {canonicalize_name(d) for d in dists}
    return found


@pytest.mark.parametrize(
    ("folder", "extras_allowed"),
    [
        ("bam_jax", tuple(PROJECT["optional-dependencies"])),
        ("train", ("train",)),
        ("configs", ("train",)),
        ("eval", ("eval",)),
        ("quickstart", ("train", "eval")),
        ("tests", TEST_EXTRAS),
    ],
)
def test_every_imported_distribution_is_declared(folder: str, extras_allowed: tuple[str, ...]):
    declared = requirement_names(PROJECT["dependencies"]) | extra_names(*extras_allowed)
    undeclared = distributions_of(third_party_imports(folder)) - declared
    assert not undeclared, f"{folder}/ imports {sorted(undeclared)}, not declared for it"


def test_the_commands_check_the_packages_their_extras_declare():
    for extra, requirements in extras.EXTRA_REQUIREMENTS.items():
        assert {canonicalize_name(d) for d in requirements} == extra_names(extra), extra


def test_every_package_folder_is_installed():
    folders_with_init = {
        ".".join([FOLDERS[path.parts[0]], *path.parts[1:-1]])
        for folder in FOLDERS
        for path in (p.relative_to(ROOT) for p in (ROOT / folder).rglob("__init__.py"))
    }
    assert folders_with_init == set(PYPROJECT["tool"]["setuptools"]["packages"])
    assert (ROOT / "bam_jax" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["bam_jax"]


def test_no_source_imports_a_folder_name():
    """`import train` would load a second copy of bam_train's modules (and their state)."""
    old_names = set(PACKAGE_DIR.values())
    found = []
    for path in ROOT.glob("*/**/*.py"):
        if path.relative_to(ROOT).parts[0] not in {*FOLDERS, "tests", "bench"}:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            found += [f"{path}:{node.lineno}" for n in names if n.split(".")[0] in old_names]
    assert not found, "imports by folder name:\n" + "\n".join(found)


def test_commands_load_each_module_under_one_name():
    """From a checkout's root (where train/ is importable as `train`), the commands and
    `python -m train` / `python -m eval` load the modules as bam_* only."""
    script = (
        "import runpy, sys, json\n"
        "import bam_train.cli, bam_eval.cli, bam_quickstart.run, bam_configs.presets\n"
        "codes = []\n"
        "for folder in ('train', 'eval'):\n"
        "    sys.argv = [folder, '--help']\n"
        "    try:\n"
        "        runpy.run_module(folder, run_name='__main__', alter_sys=True)\n"
        "    except SystemExit as exit:\n"
        "        codes.append(exit.code)\n"
        "print(json.dumps({'codes': codes, 'modules': sorted(sys.modules)}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["codes"] == [0, 0], result.stdout[-3000:]
    old_names = set(PACKAGE_DIR.values())
    twice = [m for m in report["modules"] if m.split(".")[0] in old_names]
    assert set(twice) <= {"train", "eval"}, f"loaded under a folder name: {twice}"


def test_the_library_imports_with_the_default_dependencies_only():
    """`import bam_jax` and its public API need nothing an extra installs."""
    allowed = sorted(dependency_closure(PROJECT["dependencies"]) | {"bam-jax"})
    script = (
        "import importlib.metadata, json, sys\n"
        f"allowed = set({json.dumps(allowed)})\n"
        "providers = importlib.metadata.packages_distributions()\n"
        "canonical = lambda name: name.lower().replace('_', '-').replace('.', '-')\n"
        "class RefuseExtras:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        dists = providers.get(name.partition('.')[0], [])\n"
        "        if dists and not any(canonical(d) in allowed for d in dists):\n"
        "            raise ModuleNotFoundError(f'{name} is not a default dependency', name=name)\n"
        "sys.meta_path.insert(0, RefuseExtras())\n"
        "import bam_jax, bam_jax.linen, bam_jax.extras\n"
        "[getattr(bam_jax, name) for name in bam_jax.__all__]\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]


def dependency_closure(requirements: list[str]) -> set[str]:
    """Canonical names of the installed distributions the requirements pull in."""
    seen: set[str] = set()
    pending = [Requirement(r) for r in requirements]
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        for line in importlib.metadata.requires(requirement.name) or []:
            dependency = Requirement(line)
            wanted = {""} | requirement.extras
            if dependency.marker is None or any(
                dependency.marker.evaluate({"extra": extra}) for extra in wanted
            ):
                pending.append(dependency)
    return seen


def test_version_comes_from_the_installed_metadata():
    assert bam_jax.__version__ == importlib.metadata.version("bam-jax")


def test_version_of_a_checkout_that_was_never_installed():
    script = (
        "import importlib.metadata\n"
        "def not_installed(name):\n"
        "    raise importlib.metadata.PackageNotFoundError(name)\n"
        "importlib.metadata.version = not_installed\n"
        "import bam_jax\n"
        "print(bam_jax.__version__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "0+unknown"


@pytest.fixture
def without_modules(monkeypatch):
    """Makes importlib.util.find_spec report the given modules as not installed."""
    find_spec = importlib.util.find_spec

    def hide(*hidden: str) -> None:
        def fake_find_spec(name: str, package: str | None = None):
            if name in hidden:
                return None
            if any(name.startswith(f"{h}.") for h in hidden):
                raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")
            return find_spec(name, package)

        monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)

    return hide


def test_bam_train_without_its_extra_says_what_to_install(without_modules):
    without_modules("optax")
    with pytest.raises(SystemExit) as exit:
        train_entry.main()
    assert exit.value.code == (
        "bam-train needs the training extra: pip install 'bam-jax[train]' (missing: optax)"
    )


def test_bam_eval_names_every_missing_package(without_modules):
    without_modules("matplotlib", "orbax")
    with pytest.raises(SystemExit) as exit:
        eval_entry.main()
    assert exit.value.code == (
        "bam-eval needs the evaluation extra: pip install 'bam-jax[eval]' "
        "(missing: orbax-checkpoint, matplotlib)"
    )


def test_bam_quickstart_needs_both_extras(without_modules):
    without_modules("grain")
    with pytest.raises(SystemExit) as exit:
        quickstart_entry.main()
    assert exit.value.code == (
        "bam-quickstart needs the training and evaluation extras: "
        "pip install 'bam-jax[train,eval]' (missing: grain)"
    )


def test_a_command_with_its_extra_runs(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bam-eval", "--help"])
    with pytest.raises(SystemExit) as exit:
        eval_entry.main()
    assert exit.value.code == 0
    assert re.search(r"usage: bam-eval", capsys.readouterr().out)


def ci_script_lines() -> list[str]:
    text = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def test_ci_runs_the_readme_test_command_verbatim_last():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    test_line = next(line for line in readme.splitlines() if line.endswith("&& pytest"))
    assert ci_script_lines()[-1] == test_line


def test_ci_also_runs_the_suite_on_the_newest_python_and_packages():
    lines = ci_script_lines()
    newest_venv = [line for line in lines if "-m venv .venv-newest" in line]
    assert newest_venv, "no second virtual environment in .ci/run"
    upgrade = [line for line in lines if "install" in line and "--upgrade -e '.[test]'" in line]
    assert upgrade, ".ci/run does not install the newest releases in the second stack"
    assert lines.count("pytest") >= 1 and lines.index("pytest") > lines.index(upgrade[0])
    assert '"$newest" -m venv .venv-newest' in lines
    assert any("/versions/*/bin/python3" in line for line in lines), "pyenv's Pythons not searched"


def test_benchmarks_and_tests_import_each_other_only_as_packages():
    for path in [*ROOT.glob("tests/**/*.py"), *ROOT.glob("bench/*.py")]:
        source = path.read_text(encoding="utf-8")
        assert not edits_import_path(source), f"{path.relative_to(ROOT)} edits sys.path"
        if path.parent.name == "bench":
            assert "tests" not in imported_names(source), f"{path.relative_to(ROOT)}"
        else:
            test_modules = re.findall(r"^\s*(?:from|import) tests\.[\w.]*\btest_\w+", source, re.M)
            assert not test_modules, f"{path.relative_to(ROOT)} imports a test file: {test_modules}"


def imported_names(source: str) -> set[str]:
    """Top-level names of every module `source` imports (also in functions)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def edits_import_path(source: str) -> bool:
    """Whether `source` calls a method of sys.path (insert, append, ...)."""
    return any(
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "path"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "sys"
        for node in ast.walk(ast.parse(source))
    )


def _package_imports() -> dict[str, set[str]]:
    """Installed package -> the other installed packages its modules import."""
    packages = {name.split(".")[0] for name in PYPROJECT["tool"]["setuptools"]["packages"]}
    edges: dict[str, set[str]] = {name: set() for name in packages}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                else:
                    continue
                edges[package] |= {n.split(".")[0] for n in names} & packages - {package}
    return edges


def test_the_packages_import_each_other_without_a_cycle():
    edges = _package_imports()
    assert "bam_train" not in edges["bam_configs"], "the presets import the trainer"
    assert edges["bam_jax"] == set(), "the library imports a command's package"

    def reaches(start: str, goal: str, seen: frozenset = frozenset()) -> bool:
        return any(
            n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in edges[start]
        )

    cycles = sorted(package for package in edges if reaches(package, package))
    assert not cycles, f"packages in an import cycle: {cycles} ({edges})"


def test_building_every_preset_imports_no_data_pipeline_or_trainer():
    script = (
        "import sys\n"
        "from bam_configs.presets import TRAINING_PRESETS, preset\n"
        "for name in TRAINING_PRESETS:\n"
        "    preset(name)\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('grain', 'bam_train')]\n"
        "print(sorted(loaded))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
