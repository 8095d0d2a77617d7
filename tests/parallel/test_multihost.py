"""Two hosts on this machine: two processes joined by jax.distributed (localhost coordinator,
one CPU device each, gloo collectives), tensor parallelism 2 spanning both. Rank 0 schedules;
rank 1 runs the same steps. Same greedy tokens and logprobs as one process with one device."""

import json
import os
import socket
import subprocess
import sys

import numpy as np

from tests.parallel.multihost_worker import ENGINE, constrained_params, extra_params
from tests.parallel.worker import prompts_and_params
from tests.tiny_models import tiny_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_hosts_give_one_hosts_tokens_and_an_abort_on_rank_0_reaches_both():
    from jaxpaged import LLM

    path = tiny_checkpoint("llama", num_key_value_heads=4)
    port = _free_port()
    flags = os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")   # one device each
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.parallel.multihost_worker", str(rank), str(port), path],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:   # a hang: neither host may outlive the test
            for p in procs:
                p.kill()
            raise
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, err[-4000:]
        results.append(json.loads(lines[-1][len("RESULT "):]))
    leader, follower = results

    prompts, params = prompts_and_params()
    llm = LLM(path, use_tqdm=False, **ENGINE)
    outs = llm.generate(prompts, params, use_tqdm=False)
    extra = llm.generate(prompts[:4], extra_params(), use_tqdm=False)
    assert leader["extra"] == [[c.token_ids for c in o.outputs] for o in extra]
    constrained = llm.generate(prompts[:3], [constrained_params(), params, constrained_params()], use_tqdm=False)
    assert leader["constrained"] == [[c.token_ids for c in o.outputs] for o in constrained]
    assert leader["swapped"] > 0   # rank 1 replayed swap-outs and swap-ins too
    assert leader["tokens"] == [o.outputs[0].token_ids for o in outs]
    assert leader["tier_hits"] > 0 and leader["again"] == leader["tokens"]   # and the host tier's stores and loads
    np.testing.assert_allclose(
        np.array(leader["logprobs"]),
        np.array([[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]),
        atol=1e-4)
    # the request left after the abort finished with the tokens it gets alone, and rank 1 ran
    # exactly rank 0's steps (the aborted request's included, none after it)
    assert leader["kept"] == outs[0].outputs[0].token_ids
    assert follower["steps"] == leader["steps"] > 0
