"""What the fault tests share beyond the harness: long simulated requests, the
KV router's hit rate through the frontend, and a record of measured figures."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import aiohttp

from harness import ARTIFACTS
from harness.engine import long_sim_args
from harness.waits import wait_until_probe_async

# Long requests: EOS never likeliest, 20 ms per decode step.
LONG_SIM_ARGS = (
    *long_sim_args(decode_step_ms=20),
    "--block-size",
    "16",
    "--num-kv-blocks",
    "20000",
)
FIGURES = ARTIFACTS / "faults"


def record(name: str, **figures: Any) -> None:
    """Print measured figures and keep them in .artifacts/faults/<name>.json."""
    FIGURES.mkdir(parents=True, exist_ok=True)
    (FIGURES / f"{name}.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(f"\n[faults] {name}: {json.dumps(figures)}", flush=True)


def prompt(seed: int, length: int = 40) -> list[int]:
    return [(seed * 131 + i * 17) % 900 + 3 for i in range(length)]


# Six full blocks of 16: what the KV router scores.
KV_PROMPT = [(i * 37) % 800 + 5 for i in range(96)]


def kv_prompt(seed: int) -> list[int]:
    """Six full blocks of 16, different per seed."""
    return [(seed * 97 + i * 37) % 800 + 5 for i in range(96)]


async def kv_hit_rate(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    check: bool = True,
    tokens: Sequence[int] = KV_PROMPT,
) -> float | None:
    """The router's KV hit rate for ``tokens`` plus one token (None: not served)."""
    body = {
        "model": model,
        "prompt": [*tokens, 999],
        "max_tokens": 2,
        "nvext": {"extra_fields": ["timing"]},
    }
    async with session.post(f"{base_url}/v1/completions", json=body) as resp:
        answer = await resp.json(content_type=None)
        if resp.status != 200 and not check:
            return None
        assert resp.status == 200, answer
    return float(answer["nvext"]["timing"].get("kv_hit_rate") or 0.0)


async def wait_kv_hit(
    session: aiohttp.ClientSession, base_url: str, model: str, tokens: Sequence[int]
) -> float:
    """Until the router scores hits for ``tokens`` (KV events travel asynchronously):
    that hit rate; WaitTimeout after 15 s."""
    return await wait_until_probe_async(
        lambda: kv_hit_rate(session, base_url, model, tokens=tokens),
        15,
        "the router to score KV hits",
        interval=0.2,
    )
