"""Part 5 of ``make bench``: rollouts on ``AsyncLLM`` called directly, no server.

``python -m bench.vllm_direct CTL_DIR <vLLM engine server flags>``: the engine
is built exactly as the engine server builds it (``bench.local_engine`` with
the vllm backend), then requests go straight to ``AsyncLLM.generate`` with the
sampling parameters the Rollout RPC would use. ``CTL_DIR/ready`` appears when
it serves; a ``CTL_DIR/request`` file ``[prompts.json, concurrency, n, rep]``
runs one measurement into ``CTL_DIR/result-<rep>.json``; ``CTL_DIR/quit`` ends.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
from pathlib import Path

from bench.local_engine import LocalEngine
from bench.stats import closed_loop
from engine_contract.v1 import engine_pb2 as pb
from engine_server import admission


async def main() -> None:
    from engine_server.backends.vllm import VllmBackend
    from engine_server.backends.vllm.sampling import to_sampling_params

    ctl = Path(sys.argv[1])
    ctl.mkdir(parents=True, exist_ok=True)
    local = LocalEngine(["--backend", "vllm", *sys.argv[2:]])
    await local.start()
    backend = local.core.backend
    assert isinstance(backend, VllmBackend)
    engine = backend.engine
    serving = local.core.serving()
    limits = local.core.config.limits
    (ctl / "ready").write_text("")
    ids = itertools.count(1)
    while not (ctl / "quit").exists():
        request = ctl / "request"
        if not request.exists():
            await asyncio.sleep(0.02)
            continue
        prompts_file, concurrency, n, rep = json.loads(request.read_text())
        request.unlink()
        prompts: list[list[int]] = json.loads(Path(prompts_file).read_text())

        async def send(i: int, prompts: list[list[int]] = prompts) -> None:
            plan = admission.plan_rollout(
                pb.RolloutRequest(
                    request_id=f"d{next(ids)}",
                    prompt_token_ids=prompts[i % len(prompts)],
                    greedy=True,
                ),
                serving.info,
                serving.defaults,
                limits,
            )
            params = to_sampling_params(plan.spec)
            final = None
            async for out in engine.generate(
                {"prompt_token_ids": list(plan.prompt_token_ids)}, params, plan.request_id
            ):
                final = out
            assert final is not None and final.finished

        started = time.perf_counter()
        cell = await closed_loop("direct", send, concurrency, n)
        result = {
            "n": cell.n,
            "seconds": cell.seconds,
            "latencies_s": cell.latencies_s,
            "errors": cell.errors,
            "wall": time.perf_counter() - started,
        }
        (ctl / f"result-{rep}.json").write_text(json.dumps(result))
    await local.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
