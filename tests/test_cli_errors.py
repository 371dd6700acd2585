"""Command-line usage errors: each is one ``error:`` line naming the argument, exit status 2;
`serve --help` shows real defaults and the preset choices; `store` defaults to the store
directory `serve` uses (``XDG_CACHE_HOME`` honoured); `serve` PINGs a Redis pool at start-up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from replaykv.engine.config import EngineConfig, default_store_dir
from tests.cache.conftest import redis_server, redis_url  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAYKV_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra)
    return env


def replaykv(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "replaykv", *args],
        capture_output=True,
        text=True,
        env=_env(**env),
        cwd=REPO,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["generate", "--model", "/nonexistent/model"], "--model"),
        (["generate", "--preset", "nope"], "--preset"),
        (["generate", "--preset", "tiny", "--max-tokens", "-3"], "--max-tokens"),
        (["generate", "--preset", "tiny", "--chunk", "abc"], "--chunk"),
        (["generate", "--preset", "tiny", "--device", "nodevice"], "--device"),
        (["score", "--model", "/nonexistent", "--input-ids", "/nonexistent/ids.json", "--out", "x.npy"], "--input-ids"),
        (["serve", "--port", "abc"], "--port"),
        (["serve", "--preset", "tiny", "--device", "nodevice"], "--device"),
        (["serve", "--preset", "nope"], "--preset"),
        (["serve", "--max-running-requests", "0"], "--max-running-requests"),
        (["plan", "--no-such-flag"], "--no-such-flag"),
        (["accept", "--no-such-flag"], "--no-such-flag"),
        (["store", "frob"], "command"),
        (["store", "stats", "--no-such-flag"], "--no-such-flag"),
        (["train", "--recipe", "tiny", "--out", "x", "--stages", "0"], "--stages"),
        (["train", "--recipe", "nope", "--out", "x"], "--recipe"),
        (["train", "--recipe", "tiny", "--out", "x", "--shard-size", "100KiB"], "--shard-size"),
        (["train", "--recipe", "tiny", "--out", "x", "--shard-size", "50%"], "--shard-size"),
        (["train", "--recipe", "tiny", "--out", "x", "--precision", "fp8"], "--precision"),
        (["train", "--recipe", "tiny", "--out", "x", "--pipeline-stages", "0"], "--pipeline-stages"),
        (["train", "--recipe", "tiny", "--out", "x", "--pipeline-stages", "2", "--ship"], "--ship"),
        (["train", "--recipe", "tiny", "--out", "x", "--pipeline-stages", "3", "--micro-batches", "2"], "micro-batches"),
        (["train", "--recipe", "tiny", "--out", "x", "--pipeline-stages", "2", "--stage-boundaries", "a"], "--stage-boundaries"),
        (["train", "--recipe", "tiny", "--out", "x", "--pipeline-stages", "2", "--stage-boundaries", "12"], "boundaries"),
        (["train", "--recipe", "adapt", "--out", "x", "--pipeline-stages", "2"], "follow-up paths"),
        (["train", "--recipe", "small", "--out", "x", "--context-parallel", "3"], "shards of equal length"),
        (["route", "--replica", "nope"], "--replica"),
        (["route", "--replica", "http://127.0.0.1:1", "--cache-threshold", "2"], "--cache-threshold"),
        (["route"], "--replica"),
    ],
)
def test_a_usage_error_is_one_line(args: list[str], named: str, tmp_path: Path) -> None:
    got = replaykv(*args, XDG_CACHE_HOME=str(tmp_path))
    lines = got.stderr.splitlines()
    assert got.returncode == 2, got.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], got.stderr


def test_generate_with_a_model_directory_without_config(tmp_path: Path) -> None:
    got = replaykv("generate", "--model", str(tmp_path))
    assert got.returncode == 2 and got.stderr.splitlines() == [
        f"error: --model {tmp_path} holds no config.json (a model directory: config.json + safetensors)"
    ]


def test_serve_help_shows_real_defaults_and_preset_choices() -> None:
    got = replaykv("serve", "--help")
    assert got.returncode == 0
    text = " ".join(got.stdout.split())
    assert "default the engine's" not in text
    assert "--preset {small,tiny,v4-flash,v4-tiny,v41-flash,v41-small,v41-small-vision,v41-tiny,v41-tiny-smooth,v41-tiny-vision}" in text
    defaults = EngineConfig()
    assert f"REPLAYKV_MAX_RUNNING_REQUESTS; default {defaults.max_batch})" in text
    assert f"REPLAYKV_CONTEXT_LENGTH; default {defaults.max_context})" in text
    assert f"REPLAYKV_SWA_POOL; default {defaults.swa_pool})" in text
    assert f"REPLAYKV_SWA_POOL_TTL; default {defaults.swa_pool_ttl_s})" in text


def test_store_defaults_to_the_serve_directory_under_xdg_cache_home(tmp_path: Path) -> None:
    xdg = tmp_path / "xdg"
    store = xdg / "replaykv" / "store"
    got = replaykv("store", "stats", XDG_CACHE_HOME=str(xdg))
    assert got.returncode == 2 and str(store) in got.stderr  # nothing there yet
    # the directory `serve` fills by default, opened by `store` without --cache-dir
    script = (
        "from replaykv.cache.stores import make_store\n"
        "from replaykv.engine.config import EngineConfig\n"
        "s = make_store(None, EngineConfig().store_dir, capacity_bytes=1 << 30)\n"
        "s.close()\n"
    )
    made = subprocess.run([sys.executable, "-c", script], env=_env(XDG_CACHE_HOME=str(xdg)), capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    got = replaykv("store", "stats", "--json", XDG_CACHE_HOME=str(xdg))
    assert got.returncode == 0, got.stderr
    assert '"entries": 0' in got.stdout or '"entries":0' in got.stdout, got.stdout


def test_default_store_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_store_dir() == str(tmp_path / "replaykv" / "store")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # not absolute: ignored, as XDG says
    assert default_store_dir() == str(Path.home() / ".cache" / "replaykv" / "store")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_store_dir() == str(Path.home() / ".cache" / "replaykv" / "store")


def _serve_start_up_text(tmp_path: Path, url: str) -> str:
    cmd = [sys.executable, "-m", "replaykv", "serve", "--preset", "tiny", "--port", "0"]
    cmd += ["--swa-pool", "redis", "--redis-url", url, "--cache-dir", str(tmp_path), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO)
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        for line in proc.stdout:
            lines.append(line)
            if "serving at" in line:
                break
        return "".join(lines)
    finally:
        proc.terminate()
        proc.wait(30)


def test_serve_pings_an_unreachable_redis_at_start_up(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"redis://127.0.0.1:{port}/0"
    out = _serve_start_up_text(tmp_path, url)
    assert f"WARNING: SWA pool Redis at {url} does not answer PING (check --redis-url)" in out, out


@pytest.mark.redis
def test_serve_pings_a_live_redis_at_start_up(tmp_path: Path, redis_url: str) -> None:  # noqa: F811
    out = _serve_start_up_text(tmp_path, redis_url)
    assert f"replaykv: SWA pool Redis at {redis_url} answers PING" in out, out
    assert "WARNING" not in out
