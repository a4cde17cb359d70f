"""A generation worker as RL frameworks write them, for the host-embedding tests.

It owns its engine on its own running loop (a vLLM ``AsyncLLM``, or the sim),
configured its own root log handler and its own SIGTERM handler before calling
``engine_server.host.start_dynamo_endpoint`` once. It then writes a JSON status
file (the bridge's pid, its engine server's address), answers "direct" greedy
generations on its engine when asked through a request file, and runs until
SIGTERM.

    python -m tests.e2e.host_worker --engine vllm|sim --model DIR --name NAME \
        --namespace NS --status FILE [--worker-idx N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

HOST_FORMAT = "HOST %(levelname)s %(name)s: %(message)s"


async def direct_greedy(engine: Any, prompts: list[list[int]], max_tokens: int) -> list[Any]:
    """Greedy generations on the host's own AsyncLLM, processed logprobs of the
    sampled tokens (what rollouts report)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)
        final = None
        async for output in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, f"d{i}"):
            final = output
        assert final is not None
        comp = final.outputs[0]
        tokens = list(comp.token_ids)
        logprobs = [entry[t].logprob for entry, t in zip(comp.logprobs, tokens, strict=True)]
        out.append({"token_ids": tokens, "logprobs": logprobs})
    return out


def write_json(path: Path, value: Any) -> None:
    """Atomically: the test polls these files."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def take_request(path: Path) -> Any:
    if not path.exists():
        return None
    value = json.loads(path.read_text())
    path.unlink()
    return value


def make_engine(kind: str, model: str) -> Any:
    if kind == "sim":
        from engine_server.backends.sim import SimBackend

        return SimBackend(model=model, decode_step_ms=2.0, eos_rate=0.0)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from engine_server.vllm_processes import before_engine_start

    before_engine_start()  # its sockets and EngineCore go with this process
    return AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=model,
            enforce_eager=True,
            dtype="float32",
            max_model_len=1024,
            kv_cache_memory_bytes=64 << 20,
            block_size=32,
        )
    )


async def main(args: argparse.Namespace) -> int:
    from engine_server.host import start_dynamo_endpoint

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    status = Path(args.status)

    # The host's own SIGTERM handler, as Ray installs one: it must still run.
    def on_sigterm(signum: int, frame: Any) -> None:
        Path(args.status).with_suffix(".sigterm").write_text("host handler ran\n")
        loop.call_soon_threadsafe(stop.set)

    signal.signal(signal.SIGTERM, on_sigterm)
    engine = make_engine(args.engine, args.model)
    endpoint = await start_dynamo_endpoint(
        engine,
        model_path=args.model,
        served_model_name=args.name,
        namespace=args.namespace,
        engine_env=json.loads(args.engine_env),
        bridge_args=["--log-level", "info"],
        worker_idx=args.worker_idx,
        exit_after_engine_gone_s=5.0,
    )
    state: dict[str, Any] = {
        "serving": endpoint.serving,
        "reason": endpoint.reason,
        "address": endpoint.address,
        "bridge_pid": endpoint.bridge.pid if endpoint.bridge else None,
        "root_handlers": [type(h).__name__ for h in logging.getLogger().handlers],
    }
    write_json(status, state)
    while not stop.is_set():
        ask = take_request(status.with_suffix(".direct"))
        if ask is not None:
            answer = await direct_greedy(engine, ask["prompts"], ask["max_tokens"])
            write_json(status.with_suffix(".answer"), answer)
        state["bridge_pid"] = endpoint.bridge.pid if endpoint.bridge else None
        state["restarts"] = endpoint.restarts
        write_json(status, state)
        try:
            await asyncio.wait_for(stop.wait(), 0.2)
        except TimeoutError:
            pass
    await endpoint.stop()
    logging.getLogger("host").info("endpoint stopped; engine still usable: %s", engine is not None)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=["sim", "vllm"], default="sim")
    parser.add_argument("--model", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--status", required=True)
    parser.add_argument("--engine-env", default="{}")
    parser.add_argument("--worker-idx", type=int, default=0)
    args = parser.parse_args()
    # The host's own logging, set up before the call: it must stay as it is.
    logging.basicConfig(level=logging.INFO, format=HOST_FORMAT, stream=sys.stdout, force=True)
    if args.engine == "vllm":
        from engine_server.backends.vllm._env import apply_env_defaults

        apply_env_defaults()
    sys.exit(asyncio.run(main(args)))
