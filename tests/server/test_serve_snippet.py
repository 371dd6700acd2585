"""The snippets `replaykv serve` prints run as pasted against the live server: the Python one
(every module it imports comes with the `serve` extra that `make serve` installs) and the curl
command."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _printed_snippet(out: str) -> str:
    """The indented block under "Or from Python:" in the start-up text."""
    block = out.split("Or from Python:\n", 1)[1]
    lines = []
    for line in block.splitlines():
        if not line.startswith("  "):
            break
        lines.append(line)
    return textwrap.dedent("\n".join(lines)) + "\n"


def _requirement_name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower().replace("_", "-")


def test_the_printed_snippets_run_with_the_serve_extra(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "replaykv", "serve", "--preset", "tiny", "--port", "0"]
    cmd += ["--cache-dir", str(tmp_path), "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAYKV_")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        for line in proc.stdout:
            lines.append(line)
            if "print(r.choices[0].message.content" in line:
                break
        out = "".join(lines)
        snippet = _printed_snippet(out)
        assert "OpenAI(" in snippet, out

        project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
        installed = {_requirement_name(r) for r in project["dependencies"]}
        installed |= {_requirement_name(r) for r in project["optional-dependencies"]["serve"]}
        dists = importlib.metadata.packages_distributions()
        for node in ast.walk(ast.parse(snippet)):
            if isinstance(node, ast.ImportFrom | ast.Import):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                for name in names:
                    top = str(name).split(".")[0]
                    if top in sys.stdlib_module_names:
                        continue
                    assert {d.lower() for d in dists.get(top, [])} & installed, (
                        f"the snippet imports {top!r}, which the serve extra does not install"
                    )

        script = tmp_path / "snippet.py"
        script.write_text(snippet)
        # the socket listens before the text is printed: an early connect waits in its backlog
        ran = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
        )
        assert ran.returncode == 0, ran.stderr
        assert "completion_tokens=" in ran.stdout, ran.stdout

        curl = textwrap.dedent(out.split("Try it:\n", 1)[1].split("\n\n", 1)[0])
        assert curl.startswith("curl "), out
        got = subprocess.run(["bash", "-c", curl + " --fail --silent --show-error"], capture_output=True, text=True, timeout=120)
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout)["usage"]["completion_tokens"] > 0, got.stdout
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
