"""The llama-server peer's fallback: a peer that dies while starting is started again with
`--no-repack` (llama.cpp's AMX kernels crash a native build on an AMX Xeon as it loads the
default model), and the setting it ran in goes beside its figures.

The crash needs an AMX CPU, so the peer here is a small program with llama-server's command
line that crashes (SIGSEGV, as that bug does) unless given `--no-repack`, and then answers
`/health` over real HTTP; on an AMX machine `nanoserve bench serve --compare-llama-server`
meets the real one."""

from __future__ import annotations

import stat
import sys
import urllib.request
from pathlib import Path

import pytest

from nanoserve.bench.llama_server import NO_REPACK, start_healthy_llama_server, stop_process
from nanoserve.bench.serve import free_port, llama_server, peer_name

PEER = '''\
import http.server, os, signal, sys
argv = sys.argv[1:]
if "--no-repack" not in argv or "--always-crash" in argv:
    os.kill(os.getpid(), signal.SIGSEGV)  # as ggml_backend_amx_mul_mat does on an AMX Xeon
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b'{"status": "ok"}')
    def log_message(self, *args):
        pass
port = int(argv[argv.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
'''


@pytest.fixture
def amx_crashing_peer(tmp_path: Path) -> Path:
    program = tmp_path / "llama-server"
    program.write_text(f"#!{sys.executable}\n{PEER}")
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    return program


def test_a_peer_that_dies_at_start_is_run_with_no_repack(amx_crashing_peer: Path,
                                                         tmp_path: Path) -> None:
    port = free_port()
    process, setting = start_healthy_llama_server(amx_crashing_peer, tmp_path / "m.gguf", port,
                                                  30.0, threads=1, parallel=2)
    try:
        assert setting == NO_REPACK and process.poll() is None
        assert NO_REPACK in process.args  # type: ignore[operator]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
            assert response.status == 200
    finally:
        stop_process(process)


def test_a_peer_that_dies_in_both_settings_is_an_error_naming_both(amx_crashing_peer: Path,
                                                                   tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=f"default setting and with {NO_REPACK}"):
        start_healthy_llama_server(amx_crashing_peer, tmp_path / "m.gguf", free_port(), 30.0,
                                   extra_args=["--always-crash"], threads=1)


def test_the_bench_names_the_setting_beside_the_figures(amx_crashing_peer: Path,
                                                        tmp_path: Path) -> None:
    with llama_server(tmp_path / "m.gguf", parallel=1, threads=1,
                      binary=amx_crashing_peer) as (url, setting):
        assert setting == NO_REPACK and url.startswith("http://127.0.0.1:")
    assert peer_name([setting, setting]) == "llama-server (--no-repack setting)"
    assert peer_name(["default"]) == "llama-server (default setting)"
