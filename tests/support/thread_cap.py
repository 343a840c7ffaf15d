"""A cap on the threads a process may start, switched on from inside the process.

A small library preloaded into a fresh interpreter (LD_PRELOAD) stands in front of
`pthread_create`: once the process calls `bam_cap_threads(1)`, every new thread is refused
with EAGAIN, what the system answers at a process limit, and `bam_refused_threads()` counts
the refusals. Unlike RLIMIT_NPROC, which counts every process of the user on the machine
(and does not apply to root), it depends on nothing outside the process.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from bam_jax.kernels import cpu

CAP_SOURCE = r"""
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>

#include <atomic>

namespace {
std::atomic<int> capped{0};
std::atomic<long> refused{0};
using CreateFn = int (*)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
}  // namespace

extern "C" void bam_cap_threads(int on) { capped = on; }
extern "C" long bam_refused_threads() { return refused; }

extern "C" int pthread_create(pthread_t* thread, const pthread_attr_t* attr,
                              void* (*start)(void*), void* arg) {
  static const CreateFn real = reinterpret_cast<CreateFn>(dlsym(RTLD_NEXT, "pthread_create"));
  if (capped) {
    ++refused;
    return EAGAIN;
  }
  return real(thread, attr, start, arg);
}
"""


def build_thread_cap(directory: Path) -> Path:
    """Compiles the cap into `directory` with the CPU kernel's compiler; the library."""
    source = directory / "thread_cap.cc"
    library = directory / "thread_cap.so"
    source.write_text(CAP_SOURCE)
    command = [*cpu._compiler(), "-O2", "-shared", "-fPIC", str(source), "-o", str(library)]
    subprocess.run([*command, "-ldl"], check=True, capture_output=True)
    return library
