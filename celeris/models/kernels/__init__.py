"""The C kernels of the CPU's fast pass, built on this machine at first use: the products against a GGUF file's own
weight blocks (``gguf_blocks.c``) and the small operators between them (``decode_ops.c``).

``library()`` compiles both files with the machine's C compiler (``$CC``, else ``cc`` or ``gcc``; ``FLAGS``:
``-O3 -march=native -fopenmp -ffp-contract=off``) into one ``<cache root>/kernels/celeris-<hash>.so``, the hash over
the sources, the flags, the compiler's version and the CPU's flags, so a new source, compiler or machine builds anew
and a second process loads the built file (about 1 s to build, milliseconds to load). The file is written under a
temporary name and moved into place, so a killed build never leaves a half-written library. The library is loaded
with ``ctypes`` (no PyTorch headers, no Python extension ABI). Its OpenMP runtime is the one PyTorch already loaded
(both are ``libgomp.so.1``, and the dynamic loader shares a library of one soname), so its threads and PyTorch's
are one pool.

When it cannot be built (no compiler, a compiler error, an unwritable cache), ``library()`` prints one warning line
to stderr, once per process, and returns None; callers then compute on PyTorch's path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import torch

from celeris.models.cache import cache_root

SOURCES = tuple(Path(__file__).with_name(name) for name in ("gguf_blocks.c", "decode_ops.c"))
# -ffp-contract=off: no fused multiply-add where the source has a product and a sum, so RoPE in C rounds as
# PyTorch's elementwise x * cos + rotated * sin does, bit for bit (the block kernel's own FMAs are explicit)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", "-std=c11")
ABI_VERSION = 9  # celeris_abi_version() of the source this module calls
DISABLE_ENV = "CELERIS_NO_KERNELS"  # set to 1: never build or load the kernel (the PyTorch path; for tests)


def pointer(t: torch.Tensor) -> ctypes.c_void_p:
    """The address of a tensor's first element, as a kernel argument (the caller keeps the tensor alive)."""
    return ctypes.c_void_p(t.data_ptr())


def compiler() -> str | None:
    """The C compiler to build with: ``$CC``, else ``cc``, else ``gcc`` on the PATH; None when there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def build_key(cc: str) -> str:
    """16 hex digits over what the built library depends on: source, flags, compiler version, CPU flags."""
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    parts = [*(source.read_bytes() for source in SOURCES), " ".join(FLAGS).encode(), version.encode(), _cpu_flags().encode(),
             platform.machine().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def build(target: Path, cc: str, flags: tuple[str, ...] = FLAGS) -> None:
    """Compile ``SOURCES`` into ``target`` with ``flags`` (written beside it under a temporary name, then moved into
    place).

    Raises:
        OSError: the compiler could not run or the folder cannot be written.
        RuntimeError: the compiler failed (its first error line).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + "-", suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            lines = [ln for ln in done.stderr.splitlines() if "error" in ln] or done.stderr.splitlines() or ["?"]
            raise RuntimeError(f"{Path(cc).name} failed: {lines[0].strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    for name, args, res in (
            ("celeris_abi_version", [], i32), ("celeris_simd_level", [], i32), ("celeris_tile_rows", [], i32),
            ("celeris_packed_bytes", [i32, i64, i64], i64),
            ("celeris_repack", [i32, ptr, i64, i64, ptr, i32], i32),
            ("celeris_packed_rows", [i32, ptr, i64, i64, ptr, i64, ptr], i32),
            ("celeris_packed_matmul", [i32, ptr, i64, i64, ptr, i64, ptr, i32], i32),
            ("celeris_quantize_activations", [ptr, i64, i64, ptr, ptr, ptr], i32),
            ("celeris_rms_norm", [ptr, ptr, i64, i64, ctypes.c_float, ptr], None),
            ("celeris_silu_mul", [ptr, i64, i64, ptr], None),
            ("celeris_argmax_rows", [ptr, i64, i64, ptr], None),
            ("celeris_penalized_argmax", [ptr, i64, i64, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr], None),
            ("celeris_dflash_stack", [i64, ptr, ptr, i64, ptr, i64, i64, ctypes.c_float, i64, i64, i64, i64, ptr, ptr,
                                      i64, i64, i64, i64, ctypes.c_float, ptr, i32], i32),
            ("celeris_attention", [ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64,
                                   i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr, i32], i32),
            ("celeris_rope_cache_attention", [ptr, i64, i64, i64, i64, i64, ptr, ptr, i64, i64, ptr, i64, i64, i64,
                                              ptr, i64, i64, i64, i64, ptr, ptr, i64, i64, i64, ctypes.c_float, ptr,
                                              i32], i32),
            ("celeris_decoder_layer", [ptr, i64, i64, i64, ptr, ptr, ctypes.c_float, i32, ptr, i32, ptr, i32, ptr, i32,
                                       ptr, i64, i64, i64, i64, ptr, ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, i64,
                                       i64, i64, ptr, ptr, i64, i64, i64, ctypes.c_float, ptr, i32], i32),
            ("celeris_decoder_stack", [i64, ptr, ptr, i64, i64, i64, ctypes.c_float, i64, i64, i64, i64, ptr, ptr,
                                       i64, i64, i64, i64, i64, i64, i64, i64, i64, ptr, ptr, i64, i64, i64,
                                       ctypes.c_float, ptr, i32], i32)):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def load(path: Path) -> ctypes.CDLL:
    """A built library loaded, its functions' argument and result types declared.

    Raises:
        OSError: the file cannot be loaded.
    """
    return _declare(ctypes.CDLL(str(path)))


@cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built first when this machine has none; None (after one warning line on stderr)
    when it cannot be built or loaded, or when ``$CELERIS_NO_KERNELS`` is set."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None
    cc = compiler()
    if cc is None:
        return _unavailable("no C compiler (cc, gcc, or $CC) on the PATH")
    target = cache_root() / "kernels" / f"celeris-{build_key(cc)}.so"
    try:
        if not target.exists():
            build(target, cc)
        lib = load(target)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return _unavailable(str(exc))
    if lib.celeris_abi_version() != ABI_VERSION:
        return _unavailable(f"{target} has ABI {lib.celeris_abi_version()}, not {ABI_VERSION}")
    return lib


def _unavailable(why: str) -> None:
    print(f"celeris: warning: the GGUF block kernel is unavailable ({why}); GGUF blocks are dequantized and "
          "multiplied on PyTorch's path, slower", file=sys.stderr)
    return None
