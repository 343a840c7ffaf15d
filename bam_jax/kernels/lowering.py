"""Lowering the Pallas kernels for a GPU or TPU on a host that has neither (ahead of time).

Mosaic (TPU) lowers anywhere. Pallas-Triton asks for the GPU it compiles for: jax up to
0.10 falls back to a generic target on a CPU-only host, jax 0.11 and later need an
abstract GPU device in the context, which `lower_for` provides.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Callable, Iterator
from typing import Literal

import jax
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

Platform = Literal["cuda", "tpu"]
ABSTRACT_GPU_KIND = "NVIDIA H100"
_NEEDS_ABSTRACT_GPU = jax.__version_info__ >= (0, 11)


@contextlib.contextmanager
def _target(platform: Platform, gpu_kind: str) -> Iterator[None]:
    if platform != "cuda" or not _NEEDS_ABSTRACT_GPU or jax.default_backend() == "gpu":
        yield
        return
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(gpu_kind, None, "gpu"))
    with use_abstract_mesh(mesh):
        yield


def lower_for(
    fn: Callable,
    args: tuple[jax.ShapeDtypeStruct, ...],
    platform: Platform,
    gpu_kind: str = ABSTRACT_GPU_KIND,
) -> jax.stages.Lowered:
    """jax.jit(fn) lowered for `platform`; args are shapes (ShapeDtypeStruct), not arrays,
    since no array may be created inside an abstract-device context."""
    with _target(platform, gpu_kind):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))


def kernel_modules(
    fn: Callable, args: tuple[jax.ShapeDtypeStruct, ...], platform: Platform
) -> list[str]:
    """The Triton or Mosaic modules (MLIR text) of the Pallas kernels in fn, as Pallas
    prints them when a kernel is called with debug=True."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        lower_for(fn, args, platform)
    marker = "The Triton module for" if platform == "cuda" else "The Mosaic module for"
    modules = []
    for part in printed.getvalue().split(marker)[1:]:
        body = part.split("\n", 1)[1]
        end = body.find("\nThe kernel jaxpr for")
        modules.append(body if end < 0 else body[:end])
    return modules


SPECIAL_FUNCTIONS = {
    "math.exp",
    "math.exp2",
    "math.log",
    "math.log2",
    "math.log1p",
    "math.powf",
    "math.rsqrt",
    "math.sqrt",
}
EXTERN_SPECIAL = ("exp", "log", "pow")  # libdevice symbols, e.g. __nv_exp2f
_LOCATION = re.compile(r'\s+("[^"]*")?\(#loc\d*\)\s*$|\s+loc\(.*\)\s*$')


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _loop_bodies(module: str) -> list[str]:
    """Lines inside the module's loops (scf.for regions); the whole module if it has none
    (the TPU kernel's key loop is its grid)."""
    lines = module.splitlines()
    body, depth = [], None
    for line in lines:
        if depth is not None and line.strip() and _indent(line) <= depth:
            depth = None
        if depth is not None:
            body.append(line)
        elif "scf.for" in line:
            depth = _indent(line)
    return body or lines


def _category(line: str) -> str | None:
    op = line.split("=", 1)[1].split()[0] if "=" in line else ""
    if op in SPECIAL_FUNCTIONS:
        return "special"
    if op == "tt.elementwise_inline_asm":
        return "special" if ("ex2" in line or "lg2" in line) else "alu"
    if op == "tt.extern_elementwise":
        symbol = line.split('symbol = "', 1)[1].split('"', 1)[0]
        return "special" if any(name in symbol for name in EXTERN_SPECIAL) else "alu"
    if op in ("arith.sitofp", "arith.uitofp"):
        return "int-to-float"
    if op == "arith.divf":
        return "divide"
    if op == "tt.load" and "!tt.ptr<f32>" in line:
        return "gather"
    if op.startswith(("arith.", "math.", "tpu.dynamic_rotate")) and op != "arith.constant":
        return "alu"
    return None


def tile_op_counts(module: str, rows: int, cols: int) -> dict[str, float]:
    """Elementwise ops per logit in a kernel's loop body: ops whose result is a
    rows x cols float or int tile, by category (special function, int-to-float, divide,
    gather, other ALU), divided by the number of QK^T products of that shape."""
    counts: dict[str, float] = {}
    products = 0
    shapes = (f"tensor<{rows}x{cols}x", f"vector<{rows}x{cols}x")
    for line in _loop_bodies(module):
        line = _LOCATION.sub("", line)
        if "=" not in line:
            continue
        result_type = line.rsplit(":", 1)[-1].split("->")[-1]
        if not any(shape in result_type for shape in shapes):
            continue
        if "tt.dot" in line or "tpu.matmul" in line:
            products += 1
            continue
        category = _category(line)
        if category is not None:
            counts[category] = counts.get(category, 0) + 1
    if not products:
        raise ValueError(f"no {rows} x {cols} QK^T product found in the kernel's loop body")
    return {name: count / products for name, count in sorted(counts.items())}
