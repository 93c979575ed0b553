"""llama.cpp's `llama-server`, built on demand as the peer for `nanoserve bench serve`.

The source is the llama.cpp tree vendored in the PyPI sdist of `llama-cpp-python` (a pinned
version, fetched with pip like any other package), built once for this CPU into a cache
directory. Nothing here runs at import time; building takes ~20 minutes on 2 cores.

    python -m nanoserve.bench.llama_server build    # prints the binary's path
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
_VENDOR_PREFIX = "vendor/llama.cpp/"

# A superset of the flags the vendored versions know; cmake only warns about unused ones.
# GGML_NATIVE builds for this CPU (AVX2/AVX-512 where present), which is the fair peer for a
# benchmark on the same machine. No GPU backend, no HTTPS (OpenSSL) and no web UI: the UI
# assets would otherwise be downloaded at build time, and the benchmark needs none of them.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF",
    "-DGGML_CCACHE=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)


def _log(message: str) -> None:
    print(f"[llama-server] {message}", file=sys.stderr, flush=True)


def default_cache_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """`~/.cache/nanoserve/llama-server/<version>/`."""
    return Path.home() / ".cache" / "nanoserve" / "llama-server" / version


def binary_path(cache_dir: Path) -> Path:
    """Where the built binary lies inside a cache directory (it may not exist yet)."""
    return cache_dir / "llama.cpp" / "build" / "bin" / "llama-server"


def ensure_llama_server(cache_dir: Path | None = None, jobs: int | None = None) -> Path:
    """The path of a built `llama-server`; fetches the sdist and builds it first if missing.

    Safe to call from several processes at once: the build holds a lock in the cache dir.
    """
    cache_dir = cache_dir or default_cache_dir()
    binary = binary_path(cache_dir)
    if binary.is_file():
        return binary
    source = llama_cpp_source(cache_dir)
    with _locked(cache_dir / ".build.lock"):
        if binary.is_file():  # another process built it while we waited for the lock
            return binary
        _build(source, jobs or os.cpu_count() or 1)
    if not binary.is_file():
        raise RuntimeError(f"the build finished but {binary} is missing")
    _log(f"built {binary}")
    return binary


def llama_cpp_source(cache_dir: Path | None = None) -> Path:
    """The llama.cpp source tree vendored in the sdist, extracted (not built) in the cache dir:
    `<cache>/llama.cpp`, fetched and extracted first if missing (the tests read its vocabulary
    files, templates and test vectors). Several processes may call it at once: the extraction
    holds the build's lock, and a tree already there is returned without it."""
    cache_dir = cache_dir or default_cache_dir()
    source = cache_dir / "llama.cpp"
    if (source / "models").is_dir():  # (extracted whole: it appears by a rename)
        return source
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _locked(cache_dir / ".build.lock"):
        if not (source / "models").is_dir():  # another process may have extracted it
            _extract_vendored_source(_fetch_sdist(cache_dir), source)
    return source


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _fetch_sdist(cache_dir: Path, version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """The `llama-cpp-python` sdist in the cache dir, downloaded with pip when absent."""
    name = f"llama_cpp_python-{version}.tar.gz"
    sdist = cache_dir / name
    if sdist.is_file():
        return sdist
    _log(f"downloading the llama-cpp-python {version} sdist with pip")
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={version}", "-d", tmp])
        found = sorted(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if not found:
            raise RuntimeError(f"pip downloaded no llama-cpp-python sdist into {tmp}")
        found[0].replace(sdist)
    return sdist


def _extract_vendored_source(sdist: Path, dest: Path) -> None:
    """Extract `<sdist root>/vendor/llama.cpp/` to `dest` (via a temporary sibling, so an
    interrupted extraction never looks complete)."""
    _log(f"extracting vendor/llama.cpp from {sdist.name}")
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        members = list(_vendored_members(tar))
        if not members:
            raise RuntimeError(f"{sdist} holds no {_VENDOR_PREFIX} tree")
        tar.extractall(partial, members=members, filter="data")
    shutil.rmtree(dest, ignore_errors=True)
    partial.rename(dest)


def _vendored_members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """The members under `<root>/vendor/llama.cpp/`, renamed relative to that folder."""
    for member in tar.getmembers():
        _root, sep, rest = member.name.partition("/" + _VENDOR_PREFIX)
        # The tree's `.git` is a submodule pointer into the sdist's own (absent) git dir.
        if sep and rest and "/" not in _root and rest.split("/")[0] != ".git":
            member.name = rest
            if member.islnk():  # a hard link names its target by its path in the archive
                member.linkname = member.linkname.partition("/" + _VENDOR_PREFIX)[2]
            yield member


def _build(source: Path, jobs: int) -> None:
    build = source / "build"
    _log(f"configuring in {build}")
    _run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS])
    _log(f"building target llama-server with {jobs} jobs (~20 minutes on 2 cores)")
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)])


def _run(cmd: list[str]) -> None:
    # The tool's own output goes to stderr too, so stdout carries only the binary's path.
    result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"command failed ({result.returncode}): {' '.join(cmd)}")


def start_llama_server(binary: Path, gguf_path: Path, port: int, parallel: int = 32,
                       ctx_size: int | None = None, threads: int = 2,
                       log_path: Path | None = None,
                       extra_args: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """Start `llama-server` on 127.0.0.1:port serving `gguf_path` with `parallel` slots.

    llama-server splits `--ctx-size` across its slots, so the default gives each slot 512
    tokens (room for 128 + 128 and then some). `extra_args` go after the flags set here (the
    speculation of `bench spec`, say). Its log goes to `log_path` (default: a temporary file,
    named on stderr), never to a pipe nobody reads.
    """
    ctx_size = ctx_size or parallel * 512
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    cmd = [str(binary), "--model", str(gguf_path), "--host", "127.0.0.1", "--port", str(port),
           "--parallel", str(parallel), "--ctx-size", str(ctx_size),
           "--threads", str(threads), "--threads-batch", str(threads),
           # on by default in recent versions; older ones need it for continuous batching
           "--cont-batching", *extra_args]
    _log(f"starting: {' '.join(cmd)} (log: {log_path})")
    with log_path.open("wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)


# llama.cpp's AMX kernels (ggml_backend_amx_mul_mat) crash a GGML_NATIVE build on an AMX Xeon
# while it loads the default model (its warm-up decode); without repacking the weights into
# them it runs, on its AVX-512 VNNI kernels: its best working setting there.
NO_REPACK = "--no-repack"


def start_healthy_llama_server(binary: Path, gguf_path: Path, port: int, health_timeout_s: float,
                               extra_args: Sequence[str] = (), **start_args: Any
                               ) -> tuple[subprocess.Popen[bytes], str]:
    """`start_llama_server` until `/health` answers: the process and the setting it runs in
    ("default", or NO_REPACK when the default setting exited while starting and that one
    did not). A server that exits in both settings, or never answers, raises."""
    def started(args: Sequence[str]) -> subprocess.Popen[bytes]:
        process = start_llama_server(binary, gguf_path, port, extra_args=args, **start_args)
        try:
            wait_for_health(f"http://127.0.0.1:{port}", health_timeout_s, process)
        except (RuntimeError, TimeoutError):  # it exited while starting, or never answered
            stop_process(process)
            raise
        return process

    try:
        return started(extra_args), "default"
    except RuntimeError as e:
        _log(f"it exited while starting ({e}); starting it again with {NO_REPACK} "
             "(llama.cpp's AMX kernels crash on some CPUs)")
    try:
        return started([*extra_args, NO_REPACK]), NO_REPACK
    except RuntimeError as e:
        raise RuntimeError(f"llama-server exited while starting, in its default setting and "
                           f"with {NO_REPACK}: {e}") from None


def wait_for_health(base_url: str, timeout_s: float = 120.0,
                    process: subprocess.Popen[bytes] | None = None) -> float:
    """Poll `GET {base_url}/health` until it answers 200; the seconds waited.

    Raises TimeoutError after `timeout_s`, or RuntimeError at once if `process` exits (a
    server that died while loading would otherwise cost the whole timeout).
    """
    start = time.monotonic()
    url = base_url.rstrip("/") + "/health"
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before "
                               f"{url} answered")
        if _health_ok(url):
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{url} did not answer 200 within {timeout_s:.0f} s")
        time.sleep(0.25)


def _health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False  # not listening yet, or 503 while the model loads


def stop_process(process: subprocess.Popen[bytes], timeout_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if the process has not exited within `timeout_s`."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def main(argv: list[str] | None = None) -> int:
    """`python -m nanoserve.bench.llama_server build [--cache-dir D] [--jobs N]`."""
    parser = argparse.ArgumentParser(prog="python -m nanoserve.bench.llama_server",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build llama-server if missing; print its path")
    build.add_argument("--cache-dir", type=Path, default=None,
                       help=f"default: {default_cache_dir()}")
    build.add_argument("--jobs", type=int, default=None, help="default: the number of CPUs")
    args = parser.parse_args(argv)
    try:
        print(ensure_llama_server(args.cache_dir, args.jobs))
    except RuntimeError as e:
        print(f"llama-server: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
