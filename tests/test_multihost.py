"""Two processes joined by jax.distributed on this machine (2 CPU devices each, gloo collectives over localhost)
give the greedy tokens of one process with 4 devices, and only process 0 prints them.

Each process is a real `ling-jax generate` in a subprocess with a bounded wait; any still running when the test
ends (a failure, a timeout) is killed, so none outlives it.
"""

import json
import os
import socket
import subprocess
import sys

import jax
import pytest

from ling_jax.cli import main
from tests.cli_run import REPO
from tests.test_cli import two_layer_toy

RUN_TIMEOUT_S = 240
COMMON = ["generate", "--max-new-tokens", "8", "--json", "--warmup", "0", "--ignore-eos", "--tp", "4",
          "--prompt-ids", "9,41,3,99,12,250,18,5"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (tests/conftest.py sets jax_num_cpu_devices)")
def test_two_processes_give_the_tokens_of_one(tmp_path, capsys):
    from conversion.synthetic import write_synthetic

    write_synthetic(tmp_path / "hf", two_layer_toy(), seed=3, dtype="float32", progress=False)
    command = [*COMMON, "--hf-dir", str(tmp_path / "hf")]
    assert main(command) == 0
    one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"]

    address = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2"}
    procs = [subprocess.Popen([sys.executable, "-m", "ling_jax.cli", *command, "--coordinator", address,
                               "--num-processes", "2", "--process-id", str(i), "--coordinator-timeout", "60"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=RUN_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    results = [[line for line in out.splitlines() if line.startswith("{")] for out, _ in outs]
    assert len(results[0]) == 1 and not results[1], "process 0 alone prints the result"
    assert json.loads(results[0][0])["tokens"] == one
