"""`pytest --compile-report`: the programs each test file compiles, and the seconds spent.

Every process of the session (xdist workers included) listens to jax's compile events and
attaches each test's counts to its report; the controller sums them per test file and
prints a table at the end, the costliest files first. Programs compiled in subprocesses
that a test starts (command-line and multi-device runs) are not seen.

Columns: `compiled` programs built by XLA, `cache hits` programs read from the persistent
compilation cache instead, and seconds of XLA compilation, tracing and lowering to MLIR.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
from jax import monitoring

_EVENTS = {
    "/jax/core/compile/backend_compile_duration": "compile_s",
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
}
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_PROPERTY = "compile_report"


@dataclasses.dataclass
class CompileCounts:
    compiled: int = 0
    cache_hits: int = 0
    compile_s: float = 0.0
    trace_s: float = 0.0
    lower_s: float = 0.0

    def add(self, other: CompileCounts) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


class _Listener:
    """Counts jax's compile events into `current`, which each test replaces."""

    def __init__(self):
        self.current = CompileCounts()
        monitoring.register_event_duration_secs_listener(self._on_duration)
        monitoring.register_event_listener(self._on_event)

    def _on_duration(self, event: str, seconds: float, **_) -> None:
        field = _EVENTS.get(event)
        if field is None:
            return
        setattr(self.current, field, getattr(self.current, field) + seconds)
        if field == "compile_s":
            self.current.compiled += 1

    def _on_event(self, event: str, **_) -> None:
        if event == _CACHE_HIT_EVENT:
            self.current.cache_hits += 1


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--compile-report",
        action="store_true",
        help="print the jax programs compiled and the compile seconds per test file",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--compile-report"):
        config.pluginmanager.register(_CompileReport(), "compile_report_plugin")


class _CompileReport:
    def __init__(self):
        self.listener = _Listener()
        self.by_file: dict[str, CompileCounts] = collections.defaultdict(CompileCounts)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem):
        self.listener.current = CompileCounts()
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call):
        outcome = yield
        report = outcome.get_result()
        report.user_properties.append((_PROPERTY, dataclasses.asdict(self.listener.current)))
        self.listener.current = CompileCounts()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for name, value in report.user_properties:
            if name == _PROPERTY:
                self.by_file[report.nodeid.split("::")[0]].add(CompileCounts(**value))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if hasattr(terminalreporter.config, "workerinput"):
            return
        total = CompileCounts()
        rows = sorted(self.by_file.items(), key=lambda kv: -kv[1].compile_s)
        write = terminalreporter.write_line
        terminalreporter.section("compiled programs per test file")
        write(
            f"{'file':<44} {'compiled':>8} {'cache hits':>10} {'compile s':>9} "
            f"{'trace s':>8} {'lower s':>8}"
        )
        for path, counts in rows:
            total.add(counts)
            write(_row(path, counts))
        write(_row("total", total))


def _row(name: str, c: CompileCounts) -> str:
    return (
        f"{name:<44} {c.compiled:>8} {c.cache_hits:>10} {c.compile_s:>9.1f} "
        f"{c.trace_s:>8.1f} {c.lower_s:>8.1f}"
    )
