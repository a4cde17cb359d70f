"""The bridge CLI -> BridgeConfig (ours) + WorkerConfig (Dynamo's).

Dynamo's runtime options come from Dynamo's own ``DynamoRuntimeArgGroup``, so
the flags and environment variables are exactly those of Dynamo's programs
(``--discovery-backend``/``DYN_DISCOVERY_BACKEND`` with every backend Dynamo
has, ``--request-plane``/``DYN_REQUEST_PLANE``, ``--event-plane``/
``DYN_EVENT_PLANE``, ``--namespace``/``DYN_NAMESPACE``, ...).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dynamo.common.backend.worker import WorkerConfig
from dynamo.common.configuration.groups.runtime_args import (
    DynamoRuntimeArgGroup,
    DynamoRuntimeConfig,
)
from dynamo.common.configuration.utils import add_argument, add_negatable_bool_argument
from dynamo.common.utils.runtime import parse_endpoint
from dynamo.llm import ModelInput

from bridge.client import MIB, ClientOptions
from engine_contract.flags import add_deprecated, add_fields, deprecated_env, flag, from_args
from rl_client.admin_token import TOKEN_ENV, TOKEN_FILE_ENV, AdminToken
from rl_client.tls import TlsOptions

DEFAULT_COMPONENT = "backend"
DEFAULT_ENDPOINT = "generate"
# Files the Dynamo frontend reads from the model directory.
MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
# Where Dynamo 1.6.1's frontend finds a chat template besides tokenizer_config.json.
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
ROLLOUT_TRANSPORTS = ("auto", "stream", "unary")
# The bridge's own flags' environment variables: this and the flag's name.
ENV_PREFIX = "BRIDGE_"


def _mib(text: str) -> int:
    """The old --max-message-mib / BRIDGE_MAX_MESSAGE_MIB, in bytes."""
    return int(text) * MIB


def chat_template_source(model_path: Path) -> str | None:
    """Where the model's chat template is (a file name), or None when it has none."""
    for name in CHAT_TEMPLATE_FILES:
        if (model_path / name).is_file():
            return name
    try:
        config = json.loads((model_path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    if isinstance(config, dict) and config.get("chat_template"):
        return "tokenizer_config.json"
    return None


def resolve_endpoint_types(
    requested: str | None, model_path: Path, custom_template: str | None
) -> tuple[str, str]:
    """The endpoint types to register and why.

    Dynamo's frontend refuses to serve a model registered for chat without a
    chat template (it never appears in /v1/models, so not even completions
    work). Most RL base checkpoints have none, so chat is registered only when
    there is a template, unless the user asked for endpoint types explicitly.
    Raises ValueError when they asked for chat and there is no template.
    """
    source = chat_template_source(model_path)
    if custom_template:
        source = f"--custom-jinja-template {custom_template}"
    if requested is not None:
        kinds = {t.strip().lower() for t in requested.split(",") if t.strip()}
        if "chat" in kinds and source is None:
            raise ValueError(
                f"--endpoint-types {requested!r} includes chat, but the model at {model_path} "
                f"has no chat template (none in tokenizer_config.json, no "
                f"{' or '.join(CHAT_TEMPLATE_FILES)}): Dynamo's frontend would not serve the "
                "model at all. Register completions only (the default for such a model), or "
                "give a template with --custom-jinja-template"
            )
        return requested, "as asked (--endpoint-types / DYN_ENDPOINT_TYPES)"
    if source is None:
        return "completions", (
            "the model has no chat template, so chat is not registered (rollouts and "
            "completions are served; pass --custom-jinja-template to add chat)"
        )
    return "chat,completions", f"the model has a chat template ({source})"


@dataclass(frozen=True)
class BridgeConfig:
    # Fields with flag(...) metadata are flags (build_parser), each with its
    # environment variable (BRIDGE_ and the flag: BRIDGE_CONNECT_TIMEOUT_S).
    engine_address: str
    model_path: str
    served_model_name: str | None = None
    # How long start() waits for the engine server (a vLLM start can take minutes).
    connect_timeout_s: float = field(
        default=600.0,
        metadata=flag(
            "Seconds to wait at start for the engine server to be ready.",
            old=("--connect-timeout",),
        ),
    )
    client: ClientOptions = field(default_factory=ClientOptions)
    log_level: str = "INFO"
    kv_events: bool = True
    rollout_transport: str = field(
        default="auto",
        metadata=flag(
            "How rollouts reach the engine server: 'stream' multiplexes them over "
            "one Rollouts stream (far less CPU per rollout on both sides), 'unary' makes "
            "one Rollout call each, 'auto' streams when the server serves Rollouts "
            "(contract revision 2 and later).",
            choices=ROLLOUT_TRANSPORTS,
        ),
    )
    generate_transport: str = field(
        default="auto",
        metadata=flag(
            "How ordinary completions reach the engine server: 'stream' multiplexes "
            "them over one Generates stream, their deltas packed together, 'unary' makes "
            "one Generate call each, 'auto' streams when the server serves Generates "
            "(contract revision 4 and later).",
            choices=ROLLOUT_TRANSPORTS,
        ),
    )
    # Fewer messages, each costing both sides more CPU than its events; the router
    # sees events at most this much later.
    kv_max_delay_ms: int = field(
        default=2,
        metadata=flag(
            "How long the engine server may hold KV-event batches back to send "
            "several in one message, milliseconds (0-100; 0: each at once, batches "
            "already waiting still share a message)."
        ),
    )
    # Dynamo endpoint types registered ("completions", "chat,completions"), and why.
    endpoint_types: str = "chat,completions"
    endpoint_types_reason: str = ""
    # Dynamo's discovery backend ("file", "etcd", ...): how a lost registration heals.
    discovery_backend: str = "etcd"
    # How often the engine server's health is asked (with a deadline), and how
    # long it may stay unresponsive before the requests waiting on it fail.
    watch_interval_s: float = 0.25
    stall_timeout_s: float | None = field(
        default=10.0,
        metadata=flag(
            "Seconds the engine server may stay unresponsive (health asked every "
            "0.25 s with a 1 s deadline) before the requests waiting on it fail with a "
            "retryable error; 0 disables. New requests fail fast, and the worker leaves "
            "the router's pool, as soon as it stops answering.",
            name="--engine-stall-timeout-s",
            off=True,
            old=("--engine-stall-timeout",),
        ),
    )
    rollout_timeout_s: float | None = field(
        default=None,
        metadata=flag(
            "Deadline of one rollout, seconds (0: none, the default: RL generations "
            "can run long). Past it the engine request is aborted and the rollout fails "
            "with a retryable error.",
            off=True,
            old=("--rollout-timeout",),
        ),
    )
    # Set by a host that supervises the bridge, where a vanished engine server
    # means a vanished host.
    exit_after_engine_gone_s: float | None = field(
        default=None,
        metadata=flag(
            "Exit, leaving discovery, once the engine server has been unreachable "
            "for this many seconds (0: never, the default; a standalone bridge waits for "
            "its engine server to come back). engine_server.host sets it for the bridges "
            "it supervises.",
            off=True,
            old=("--exit-after-engine-gone",),
        ),
    )
    # Serve Dynamo's RL admin routes on the system port (DYN_SYSTEM_PORT), and
    # with enable_rl also describe them on the request plane ("<ns>.<component>.rl").
    rl_routes: bool = True
    enable_rl: bool = False
    namespace: str = "dynamo"
    component: str = "backend"
    request_plane: str = "tcp"
    event_plane: str | None = None
    # The bearer token every system-port path but the probes needs (None: open).
    admin_token: AdminToken | None = None
    # Register (and rejoin after an engine restart) only once the engine serves
    # the fleet's committed weights, when a trainer published them (bridge.catch_up).
    # On from the command line (--catch-up, its default); off for a config built in
    # code, which may name no reachable store (etcd is the default backend).
    catch_up: bool = False

    def __post_init__(self) -> None:
        if not self.engine_address:
            raise ValueError("an engine server address is required (--engine HOST:PORT)")
        if self.connect_timeout_s <= 0:
            raise ValueError(f"connect timeout must be > 0, got {self.connect_timeout_s}")
        if self.client.max_message_bytes <= 0:
            raise ValueError("max message size must be > 0")
        if not 0 <= self.kv_max_delay_ms <= 100:
            raise ValueError(f"KV max delay must be in [0, 100] ms, got {self.kv_max_delay_ms}")
        if not self.watch_interval_s > 0:
            raise ValueError(f"watch interval must be > 0 s, got {self.watch_interval_s}")
        for name in ("stall_timeout_s", "rollout_timeout_s", "exit_after_engine_gone_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 (or off), got {value}")
        if self.rollout_transport not in ROLLOUT_TRANSPORTS:
            raise ValueError(
                f"rollout transport must be one of {', '.join(ROLLOUT_TRANSPORTS)}, "
                f"got {self.rollout_transport!r}"
            )
        if self.generate_transport not in ROLLOUT_TRANSPORTS:
            raise ValueError(
                f"generate transport must be one of {', '.join(ROLLOUT_TRANSPORTS)}, "
                f"got {self.generate_transport!r}"
            )


class _Config(DynamoRuntimeConfig):
    """Dynamo's runtime fields plus ours (what argparse fills in)."""

    component: str
    engine: str
    model_path: str
    served_model_name: str | None = None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bridge",
        description=(
            "Serve a remote engine server (engine_contract.v1 over gRPC) as a Dynamo "
            "LLM worker. Rollouts are /v1/completions requests with a 'rollout:{...}' "
            "annotation in nvext.annotations; everything else is an ordinary completion."
        ),
        allow_abbrev=False,
    )
    g = parser.add_argument_group("Bridge options")
    add_argument(
        g,
        flag_name="--engine",
        env_var="BRIDGE_ENGINE_ADDRESS",
        default=None,
        help="Engine server address, HOST:PORT or unix:PATH.",
    )
    add_argument(
        g,
        flag_name="--model-path",
        env_var="BRIDGE_MODEL_PATH",
        default=None,
        help="Local model directory the frontend reads the tokenizer and config "
        "from (config.json, tokenizer.json, tokenizer_config.json).",
    )
    add_argument(
        g,
        flag_name="--served-model-name",
        env_var="BRIDGE_SERVED_MODEL_NAME",
        default=None,
        help="Name to serve the model under (default: the engine server's model name).",
    )
    add_fields(g, BridgeConfig, env_prefix=ENV_PREFIX)
    add_fields(g, ClientOptions, env_prefix=ENV_PREFIX)
    # The size in MiB before the unit rule (engine_contract.flags): bytes now.
    add_deprecated(
        g, "--max-message-mib", "--max-message-bytes", dest="max_message_bytes", type=_mib
    )
    old_env = deprecated_env(os.environ, "BRIDGE_MAX_MESSAGE_MIB", "BRIDGE_MAX_MESSAGE_BYTES", _mib)
    if old_env is not None:
        parser.set_defaults(max_message_bytes=old_env)
    add_argument(
        g,
        flag_name="--generate-pacing",
        env_var="BRIDGE_GENERATE_PACING",
        default="on",
        choices=["on", "off"],
        help="On a Generates stream, 'on' has the engine server send a completion's "
        "next delta once the bridge has handed the last to Dynamo, so each delta "
        "carries the tokens made meanwhile (fewer, larger deltas: less CPU per "
        "token in every process on the way); 'off' sends every delta as it comes. "
        "Needs an engine server of contract revision 6 or later (older ones stream "
        "unpaced).",
    )
    add_argument(
        g,
        flag_name="--log-level",
        env_var="BRIDGE_LOG_LEVEL",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="Level of the bridge's own logger (Dynamo's follow DYN_LOG).",
    )
    add_negatable_bool_argument(
        g,
        flag_name="--enable-rl",
        env_var="DYN_ENABLE_RL",
        default=False,
        help="Describe the RL admin routes on the request plane endpoint "
        "<namespace>.<component>.rl (method 'routes'), as dynamo.vllm --enable-rl "
        "does. The routes themselves are served on the system port either way.",
    )
    add_negatable_bool_argument(
        g,
        flag_name="--rl-routes",
        env_var="BRIDGE_RL_ROUTES",
        default=True,
        help="Serve Dynamo's RL admin routes (pause_generation, "
        "update_weights_from_disk, ...) as /engine/<name> on the system port "
        "(DYN_SYSTEM_PORT); the bridge then fronts the port and passes every other "
        "path to Dynamo's own system server.",
    )
    add_negatable_bool_argument(
        g,
        flag_name="--catch-up",
        env_var="BRIDGE_CATCH_UP",
        default=True,
        help="Before registering, and after every engine server restart, read the "
        "fleet's committed weights (the record a trainer's fleet refit publishes in the "
        "discovery store, rl_client.committed) and stay out of the router's pool until "
        "the engine serves them: a committed checkpoint the bridge loads itself, weights "
        "the trainer pushed are awaited (its keeper pushes them). Without a record the "
        "worker registers at once. --no-catch-up: register whatever the engine serves.",
    )
    add_argument(
        g,
        flag_name="--admin-token-file",
        env_var=TOKEN_FILE_ENV,
        default=None,
        help="File holding the bearer token that the system port requires as "
        "'Authorization: Bearer <token>' on every path but /health, /live and /metrics "
        "(the RL admin routes /engine/*, Dynamo's own included; the file's content, "
        "surrounding whitespace stripped; empty is refused). Without it the token is read from "
        f"${TOKEN_ENV}; with neither the routes are open to whoever reaches the port "
        "(bind it to loopback with DYN_SYSTEM_HOST=127.0.0.1). Never give the token "
        "itself as a flag: every user sees flags in ps.",
    )
    for name, env, what in (
        (
            "--engine-tls-ca",
            "BRIDGE_ENGINE_TLS_CA",
            "CA bundle (PEM) that verifies the engine "
            "server's certificate; turns TLS on (none given: the system's roots)",
        ),
        (
            "--engine-tls-cert",
            "BRIDGE_ENGINE_TLS_CERT",
            "client certificate (PEM) for an "
            "engine server that requires one (its --tls-client-ca); turns TLS on",
        ),
        ("--engine-tls-key", "BRIDGE_ENGINE_TLS_KEY", "the client certificate's private key (PEM)"),
        (
            "--engine-tls-server-name",
            "BRIDGE_ENGINE_TLS_SERVER_NAME",
            "the name the engine "
            "server's certificate must carry when it is not the host in --engine",
        ),
    ):
        add_argument(g, flag_name=name, env_var=env, default=None, help=what)
    g.add_argument(
        "--component",
        default=DEFAULT_COMPONENT,
        help="Dynamo component name when --endpoint is not given.",
    )
    g.add_argument(
        "--disable-kv-events",
        action="store_true",
        help="Do not relay the engine's KV events (no KV-aware routing).",
    )
    DynamoRuntimeArgGroup().add_arguments(parser)
    # None unless the user chose: the bridge then decides from the model's chat
    # template (see resolve_endpoint_types). The environment still counts.
    parser.set_defaults(endpoint_types=os.environ.get("DYN_ENDPOINT_TYPES"))
    return parser


def parse_args(argv: Sequence[str] | None = None) -> tuple[BridgeConfig, WorkerConfig]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.engine:
        parser.error("--engine is required (or BRIDGE_ENGINE_ADDRESS)")
    if not args.model_path:
        parser.error("--model-path is required (or BRIDGE_MODEL_PATH)")
    model_path = Path(args.model_path).expanduser()
    missing = [name for name in MODEL_FILES if not (model_path / name).is_file()]
    if missing:
        parser.error(f"--model-path {model_path} lacks {', '.join(missing)}")

    tls = None
    if args.engine_tls_ca or args.engine_tls_cert or args.engine_tls_key:
        try:
            tls = TlsOptions(
                args.engine_tls_ca,
                args.engine_tls_cert,
                args.engine_tls_key,
                args.engine_tls_server_name,
            )
        except ValueError as e:
            parser.error(str(e))
    elif args.engine_tls_server_name:
        parser.error("--engine-tls-server-name needs TLS (--engine-tls-ca or a client cert)")
    try:
        endpoint_types, why = resolve_endpoint_types(
            args.endpoint_types, model_path, args.custom_jinja_template
        )
    except ValueError as e:
        parser.error(str(e))
    args.endpoint_types = endpoint_types
    try:
        admin_token = AdminToken.resolve(args.admin_token_file)
    except ValueError as e:
        parser.error(str(e))
    runtime = _Config.from_cli_args(args)
    runtime.validate()
    endpoint = args.endpoint or f"dyn://{runtime.namespace}.{args.component}.{DEFAULT_ENDPOINT}"
    runtime.namespace, runtime.component, runtime.endpoint = parse_endpoint(endpoint)

    bridge = BridgeConfig(
        engine_address=args.engine,
        model_path=os.fspath(model_path),
        served_model_name=args.served_model_name,
        **from_args(args, BridgeConfig),
        client=ClientOptions(
            **from_args(args, ClientOptions),
            tls=tls,
            paced_generates=args.generate_pacing == "on",
        ),
        log_level=args.log_level.upper(),
        kv_events=not args.disable_kv_events,
        endpoint_types=endpoint_types,
        endpoint_types_reason=why,
        discovery_backend=str(runtime.discovery_backend),
        rl_routes=args.rl_routes,
        enable_rl=args.enable_rl,
        namespace=runtime.namespace,
        component=runtime.component,
        request_plane=str(runtime.request_plane),
        event_plane=runtime.event_plane,
        admin_token=admin_token,
        catch_up=args.catch_up,
    )
    worker = WorkerConfig.from_runtime_config(
        runtime,
        model_name=bridge.model_path,
        served_model_name=bridge.served_model_name,
        model_input=ModelInput.Tokens,
        enable_kv_routing=bridge.kv_events,
    )
    return bridge, worker
