"""Fixtures shared by the kernel tests: the C library built once per code path this CPU can run."""

from __future__ import annotations

import subprocess

import pytest

from celeris.models import kernels


@pytest.fixture(scope="session")
def variants(tmp_path_factory) -> dict[str, object]:
    """The kernel built for each code path this CPU can run (by its compiler flags), loaded."""
    cc = kernels.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    folder = tmp_path_factory.mktemp("kernels")
    base = tuple(f for f in kernels.FLAGS if not f.startswith("-march"))
    wanted = {"native": ("-march=native",), "avx2": ("-march=haswell",), "plain": ("-march=x86-64",)}
    flags = subprocess.run(["grep", "-m1", "-o", "avx2", "/proc/cpuinfo"], capture_output=True, text=True).stdout
    built = {}
    for name, march in wanted.items():
        if name == "avx2" and not flags:
            continue
        target = folder / f"{name}.so"
        kernels.build(target, cc, (*march, *base))
        built[name] = kernels.load(target)
    return built
