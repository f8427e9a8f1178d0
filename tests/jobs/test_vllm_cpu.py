"""The crash `cpu_build_settings` plans around, reproduced on the installed vLLM CPU build, so that the release that
fixes it is noticed (this test then fails: drop `--no-enable-chunked-prefill` for that release).

vLLM 0.27.1 discards the token sampled after a partial prefill and, for a seeded request, rewinds the request's random
generator to undo the draw; a CPU generator cannot rewind (`RuntimeError: CPU Generator does not use offset`) and the
engine dies. A partial prefill happens whenever a prompt is longer than the step's token budget while chunked prefill
is on, which is vLLM's default.
"""

from __future__ import annotations

import subprocess

import pytest
import requests

from jobs.demo.tiny_model import ensure_tiny_model
from jobs.ports import free_port
from jobs.processes import terminate_group
from jobs.replica.engine_command import VLLM_VERSION, EngineChoice, cpu_build_settings, engine_command, find_cpu_build
from tests.support.replica import READY_TIMEOUT_S, answers_health, tiny_spec
from tests.support.waiting import wait_until

pytestmark = pytest.mark.vllm


def test_a_seeded_prompt_prefilled_in_chunks_kills_the_cpu_build(tmp_path):
    python = find_cpu_build()
    if python is None:
        pytest.skip("vLLM's CPU build is not installed here: run scripts/setup vllm")
    workaround = "--no-enable-chunked-prefill"
    assert workaround in cpu_build_settings(VLLM_VERSION, threads=1)[0], "the workaround this test justifies"
    port = free_port()
    spec = tiny_spec("chunked-prefill", f"file://{tmp_path}", engine="vllm")
    command = engine_command(EngineChoice("vllm", "test", python), spec, ensure_tiny_model(), port)
    # vLLM's default instead of the workaround, with a step budget of 64 tokens: a 100-token prompt takes two steps.
    argv = [arg for arg in command.argv if arg != workaround] + ["--max-num-batched-tokens", "64"]
    log = tmp_path / "vllm.log"
    with open(log, "wb") as output:
        engine = subprocess.Popen(
            argv, env=command.env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: answers_health(url) or engine.poll() is not None, READY_TIMEOUT_S["vllm"], what="vLLM ready")
        assert engine.poll() is None, log.read_text()[-3000:]
        body = {"model": spec.model.id, "prompt": list(range(3, 103)), "max_tokens": 4, "seed": 1}
        unseeded = requests.post(url + "/v1/completions", json={**body, "seed": None}, timeout=120)
        assert unseeded.status_code == 200, "without a seed the same prefill is served"
        seeded = requests.post(url + "/v1/completions", json=body, timeout=120)
        assert seeded.status_code >= 500
        wait_until(lambda: "CPU Generator does not use offset" in log.read_text(errors="replace"), 60, what="the error")
        wait_until(lambda: not answers_health(url), 60, what="the engine dead")
    finally:
        terminate_group(engine.pid, grace=10.0)
        engine.wait()
