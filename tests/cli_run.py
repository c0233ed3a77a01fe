"""Run the real `ling-jax` entry point in a subprocess, as a shell would, and check how it refuses bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_ling_jax(*args, env: dict[str, str] | None = None, timeout: float = 120,
                 cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`ling-jax ARGS...` on the CPU, run in `cwd` (the package imported from this checkout wherever that is);
    `env` adds to (or overrides) the current environment."""
    full_env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "ling_jax.cli", *map(str, args)], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=cwd)


def assert_refused(result: subprocess.CompletedProcess, *fragments: str, code: int = 2) -> str:
    """The run exited with `code`, without a traceback, its stderr being at most one usage line then the error,
    which holds every fragment (the option or file named, and the fix). Returns the error message."""
    err = result.stderr
    assert result.returncode == code, f"exit code {result.returncode}, expected {code}; stderr:\n{err}"
    assert "Traceback" not in err, err
    lines = err.splitlines()
    at = next((i for i, line in enumerate(lines) if ": error: " in line), None)
    assert at is not None, f"no 'error:' line in stderr:\n{err}"
    before = lines[:at]
    assert len(before) <= 1 and all(line.startswith("usage: ") for line in before), \
        f"more than one usage line before the error:\n{err}"
    message = "\n".join(lines[at:]).split(": error: ", 1)[1]
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in the error message:\n{message}"
    return message
