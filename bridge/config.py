"""The bridge CLI -> BridgeConfig (ours) + WorkerConfig (Dynamo's).

Our flags are fields of BridgeConfig (the first ones those a supervisor sets,
``launch.bridge_command.BridgeLaunch``), ``ClientOptions`` and ``EngineTlsFiles``,
made flags by ``launch.config_flags``: the parser and the config are both built
from them. Dynamo's runtime options come from Dynamo's own
``DynamoRuntimeArgGroup``, so the flags and environment variables are exactly
those of Dynamo's programs
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
from dynamo.common.utils.runtime import parse_endpoint
from dynamo.llm import ModelInput

from bridge.client import ClientOptions
from launch.bridge_command import BridgeLaunch
from launch.config_flags import add_fields, flag, from_args, log_level_field
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
class BridgeConfig(BridgeLaunch):
    # Fields with flag(...) metadata are flags (build_parser), each with its
    # environment variable (BRIDGE_ and the flag: BRIDGE_CONNECT_TIMEOUT_S); the
    # first (engine_address to exit_after_engine_gone_s) are BridgeLaunch's.
    # Dynamo's runtime config decides them (--namespace, DYN_NAMESPACE, --endpoint):
    # the namespace, and the endpoint served (its component is ``component``).
    namespace: str = "dynamo"
    endpoint: str = DEFAULT_ENDPOINT
    # How long start() waits for the engine server (a vLLM start can take minutes).
    connect_timeout_s: float = field(
        default=600.0,
        metadata=flag("Seconds to wait at start for the engine server to be ready."),
    )
    rollout_transport: str = field(
        default="auto",
        metadata=flag(
            "How rollouts reach the engine server: 'stream' multiplexes them over "
            "one Rollouts stream (far less CPU per rollout on both sides), 'unary' makes "
            "one Rollout call each, 'auto' (the default) is 'stream': every engine "
            "server the bridge accepts serves Rollouts.",
            choices=ROLLOUT_TRANSPORTS,
        ),
    )
    generate_transport: str = field(
        default="auto",
        metadata=flag(
            "How ordinary completions reach the engine server: 'stream' multiplexes "
            "them over one Generates stream, their deltas packed together, 'unary' makes "
            "one Generate call each, 'auto' (the default) is 'stream': every engine "
            "server the bridge accepts serves Generates.",
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
        ),
    )
    rollout_timeout_s: float | None = field(
        default=None,
        metadata=flag(
            "Deadline of one rollout, seconds (0: none, the default: RL generations "
            "can run long). Past it the engine request is aborted and the rollout fails "
            "with a retryable error.",
            off=True,
        ),
    )
    client: ClientOptions = field(default_factory=ClientOptions)
    # Upper-cased when the config is made (logging's spelling).
    log_level: str = log_level_field("Level of the bridge's own logger (Dynamo's follow DYN_LOG).")
    # With enable_rl the RL admin routes are also described on the request plane
    # ("<ns>.<component>.rl"); rl_routes serves them on the system port.
    enable_rl: bool = field(
        default=False,
        metadata=flag(
            "Describe the RL admin routes on the request plane endpoint "
            "<namespace>.<component>.rl (method 'routes'), as dynamo.vllm --enable-rl "
            "does. The routes themselves are served on the system port either way.",
            env="DYN_ENABLE_RL",
            negatable=True,
        ),
    )
    rl_routes: bool = field(
        default=True,
        metadata=flag(
            "Serve Dynamo's RL admin routes (pause_generation, "
            "update_weights_from_disk, ...) as /engine/<name> on the system port "
            "(DYN_SYSTEM_PORT); the bridge then fronts the port and passes every other "
            "path to Dynamo's own system server.",
            negatable=True,
        ),
    )
    # Register (and rejoin after an engine restart) only once the engine serves
    # the fleet's committed weights, when a trainer published them (bridge.catch_up).
    # On from the command line (its default); off for a config built in code,
    # which may name no reachable store (etcd is the default backend).
    catch_up: bool = field(
        default=False,
        metadata=flag(
            "Before registering, and after every engine server restart, read the "
            "fleet's committed weights (the record a trainer's fleet refit publishes in the "
            "discovery store, rl_client.committed) and stay out of the router's pool until "
            "the engine serves them: a committed checkpoint the bridge loads itself, weights "
            "the trainer pushed are awaited (its keeper pushes them). Without a record the "
            "worker registers at once. --no-catch-up: register whatever the engine serves.",
            negatable=True,
            default=True,
        ),
    )
    # Where admin_token came from, if a file.
    admin_token_file: str | None = field(
        default=None,
        metadata=flag(
            "File holding the bearer token that the system port requires as "
            "'Authorization: Bearer <token>' on every path but /health, /live and /metrics "
            "(the RL admin routes /engine/*, Dynamo's own included; the file's content, "
            "surrounding whitespace stripped; empty is refused). Without it the token is "
            f"read from ${TOKEN_ENV}; with neither the routes are open to whoever reaches "
            "the port (bind it to loopback with DYN_SYSTEM_HOST=127.0.0.1). Never give the "
            "token itself as a flag: every user sees flags in ps.",
            env=TOKEN_FILE_ENV,
        ),
    )
    # The component registered: --component, unless --endpoint names another.
    component: str = field(
        default=DEFAULT_COMPONENT,
        metadata=flag("Dynamo component name when --endpoint is not given.", env=False),
    )
    kv_events: bool = field(
        default=True,
        metadata=flag(
            "Do not relay the engine's KV events (no KV-aware routing).",
            name="--disable-kv-events",
            env=False,
        ),
    )
    # Dynamo endpoint types registered ("completions", "chat,completions"), and why.
    endpoint_types: str = "chat,completions"
    endpoint_types_reason: str = ""
    # Dynamo's discovery backend ("file", "etcd", ...): how a lost registration heals.
    discovery_backend: str = "etcd"
    request_plane: str = "tcp"
    event_plane: str | None = None
    # The bearer token every system-port path but the probes needs (None: open).
    admin_token: AdminToken | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "log_level", self.log_level.upper())
        if self.connect_timeout_s <= 0:
            raise ValueError(f"connect timeout must be > 0, got {self.connect_timeout_s}")
        if self.client.max_message_bytes <= 0:
            raise ValueError("max message size must be > 0")
        if not 0 <= self.kv_max_delay_ms <= 100:
            raise ValueError(f"KV max delay must be in [0, 100] ms, got {self.kv_max_delay_ms}")
        if not self.watch_interval_s > 0:
            raise ValueError(f"watch interval must be > 0 s, got {self.watch_interval_s}")
        for name in ("stall_timeout_s", "rollout_timeout_s"):
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


@dataclass(frozen=True)
class EngineTlsFiles:
    """TLS to the engine server as its flags give it (``--engine-tls-*``);
    ``options()`` is what the client uses."""

    ca: str | None = field(
        default=None,
        metadata=flag(
            "CA bundle (PEM) that verifies the engine server's certificate; turns TLS "
            "on (none given: the system's roots)"
        ),
    )
    cert: str | None = field(
        default=None,
        metadata=flag(
            "client certificate (PEM) for an engine server that requires one (its "
            "--tls-client-ca); turns TLS on"
        ),
    )
    key: str | None = field(
        default=None, metadata=flag("the client certificate's private key (PEM)")
    )
    server_name: str | None = field(
        default=None,
        metadata=flag(
            "the name the engine server's certificate must carry when it is not the "
            "host in --engine"
        ),
    )

    def options(self) -> TlsOptions | None:
        """The client's TLS (None: plaintext); ValueError naming what is wrong."""
        if self.ca or self.cert or self.key:
            return TlsOptions(self.ca, self.cert, self.key, self.server_name)
        if self.server_name:
            raise ValueError(
                "--engine-tls-server-name needs TLS (--engine-tls-ca or a client cert)"
            )
        return None


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
    add_fields(g, BridgeConfig, env_prefix=ENV_PREFIX)
    add_fields(g, ClientOptions, env_prefix=ENV_PREFIX)
    add_fields(g, EngineTlsFiles, prefix="engine-tls-", env_prefix=ENV_PREFIX)
    DynamoRuntimeArgGroup().add_arguments(parser)
    # None unless the user chose: the bridge then decides from the model's chat
    # template (see resolve_endpoint_types). The environment still counts.
    parser.set_defaults(endpoint_types=os.environ.get("DYN_ENDPOINT_TYPES"))
    return parser


def parse_args(argv: Sequence[str] | None = None) -> tuple[BridgeConfig, WorkerConfig]:
    parser = build_parser()
    args = parser.parse_args(argv)
    ours = from_args(args, BridgeConfig)
    if not ours["engine_address"]:
        parser.error("--engine is required (or BRIDGE_ENGINE_ADDRESS)")
    if not ours["model_path"]:
        parser.error("--model-path is required (or BRIDGE_MODEL_PATH)")
    model_path = Path(ours["model_path"]).expanduser()
    missing = [name for name in MODEL_FILES if not (model_path / name).is_file()]
    if missing:
        parser.error(f"--model-path {model_path} lacks {', '.join(missing)}")
    try:
        tls = EngineTlsFiles(**from_args(args, EngineTlsFiles, prefix="engine-tls-")).options()
        endpoint_types, why = resolve_endpoint_types(
            args.endpoint_types, model_path, args.custom_jinja_template
        )
        admin_token = AdminToken.resolve(ours["admin_token_file"])
    except ValueError as e:
        parser.error(str(e))
    args.endpoint_types = endpoint_types
    runtime = _Config.from_cli_args(args)
    runtime.validate()
    endpoint = args.endpoint or f"dyn://{runtime.namespace}.{args.component}.{DEFAULT_ENDPOINT}"
    runtime.namespace, runtime.component, runtime.endpoint = parse_endpoint(endpoint)

    # What the flags do not give as is: read, checked or decided from them.
    derived = {
        "model_path": os.fspath(model_path),
        "client": ClientOptions(**from_args(args, ClientOptions), tls=tls),
        "endpoint_types": endpoint_types,
        "endpoint_types_reason": why,
        "discovery_backend": str(runtime.discovery_backend),
        "namespace": runtime.namespace,
        "component": runtime.component,
        "endpoint": runtime.endpoint,
        "request_plane": str(runtime.request_plane),
        "event_plane": runtime.event_plane,
        "admin_token": admin_token,
    }
    bridge = BridgeConfig(**(ours | derived))
    worker = WorkerConfig.from_runtime_config(
        runtime,
        model_name=bridge.model_path,
        served_model_name=bridge.served_model_name,
        model_input=ModelInput.Tokens,
        enable_kv_routing=bridge.kv_events,
    )
    return bridge, worker
