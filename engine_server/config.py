"""The engine server's own settings, independent of the backend."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from engine_server.addresses import parse_listen_address
from launch.config_flags import flag


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers, as a flag's value."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def port(text: str) -> int:
    """A TCP port number, as a flag's value."""
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"{number} is out of range 0..65535")
    return number


@dataclass(frozen=True)
class GenerationDefaults:
    """The launch-time generation config rollouts are sampled with (NeMo RL's).

    An empty ``stop_token_ids`` means "the model's EOS ids", filled in once the
    engine has reported them. ``stop_strings`` apply to every rollout, merged
    with the rollout's own; ``bad_words`` only on engines that support them.
    """

    # Fields with flag(...) metadata are command-line flags (engine_server.cli)
    # that override NeMo RL's generation config, when given.
    temperature: float = field(default=1.0, metadata=flag("sampling temperature"))
    top_p: float = field(
        default=1.0, metadata=flag("top-p (nucleus) sampling: the probability mass sampled from")
    )
    top_k: int = field(default=-1, metadata=flag("-1 disables"))
    max_new_tokens: int = field(default=512, metadata=flag("tokens a rollout generates at most"))
    stop_token_ids: tuple[int, ...] = field(
        default=(),
        metadata=flag("comma-separated; default: the model's EOS ids", type=int_list),
    )
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    bad_words: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top-k must be -1 (off) or >= 0, got {self.top_k}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max-new-tokens must be >= 0, got {self.max_new_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop token ids must be >= 0, got {self.stop_token_ids}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop strings must not be empty")


@dataclass(frozen=True)
class Limits:
    """Bounds on requests; over them a request gets INVALID_ARGUMENT or RESOURCE_EXHAUSTED."""

    # Fields with flag(...) metadata are command-line flags (engine_server.cli):
    # the first two in its "requests and shutdown" group, the rest (admission) in
    # its "admission limits" group.
    max_stop_strings: int = field(default=32, metadata=flag("stop strings one request may carry"))
    max_stop_string_length: int = 1024
    max_request_id_length: int = 256
    max_message_bytes: int = field(
        default=64 * 1024 * 1024,
        metadata=flag("largest gRPC message received or sent, bytes"),
    )
    max_top_logprobs: int = 20
    # Admission: over these a request fails alone with RESOURCE_EXHAUSTED naming
    # the limit (retryable), and the server's memory stays bounded whatever a
    # client sends. Sized for RL batches of many thousand concurrent rollouts.
    max_requests_in_flight: int = field(
        default=16_384, metadata=flag("requests the server holds at once")
    )
    max_rollouts_per_stream: int = field(
        default=16_384, metadata=flag("rollouts running on one Rollouts stream")
    )
    max_starts_per_message: int = field(
        default=4_096, metadata=flag("rollout starts taken from one Rollouts message")
    )
    max_waiting_requests: int = field(
        default=0,
        metadata=flag("refuse new requests while the engine has this many waiting (0: off)"),
    )
    max_kv_subscribers: int = field(default=64, metadata=flag("open SubscribeKvEvents streams"))

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            low = 0 if f.name == "max_waiting_requests" else 1
            if getattr(self, f.name) < low:
                raise ValueError(f"limit {f.name} must be >= {low}, got {getattr(self, f.name)}")


@dataclass(frozen=True)
class TlsConfig:
    """Server certificate, and client CAs when clients must present certificates."""

    # Flags --tls-cert, --tls-key, --tls-client-ca (engine_server.cli).
    cert_file: Path = field(
        metadata=flag("server certificate (PEM); enables TLS", name="--tls-cert")
    )
    key_file: Path = field(metadata=flag("server private key (PEM)", name="--tls-key"))
    client_ca_file: Path | None = field(
        default=None,
        metadata=flag(
            "CA bundle (PEM); clients must then present a certificate it signed",
            name="--tls-client-ca",
        ),
    )

    @classmethod
    def from_flags(
        cls, cert_file: Path | None, key_file: Path | None, client_ca_file: Path | None
    ) -> TlsConfig | None:
        """The TLS its flags ask for (None: plaintext); ValueError for a set that
        does not go together."""
        if cert_file or key_file:
            if not (cert_file and key_file):
                raise ValueError("--tls-cert and --tls-key go together")
            return cls(cert_file, key_file, client_ca_file)
        if client_ca_file:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None


@dataclass(frozen=True)
class RefitConfig:
    """Bounds on the refit cycle: no refit call holds the refit lock (and so the
    pause, every rollout waiting at the gate) for good."""

    # Flags --refit-check-timeout-s, --refit-timeout-s, --weights-allowed-dir.
    check_timeout_s: float = field(
        default=60.0,
        metadata=flag(
            "the longest reading a checkpoint folder's headers may take before anything "
            "loads (a hung mount); past it the update is refused and the old weights still "
            "serve"
        ),
    )
    timeout_s: float = field(
        default=1800.0,
        metadata=flag(
            "the longest one refit call's engine work may take: a load from a path, a "
            "streamed update from manifest to commit, each weight-transfer phase; past it "
            "while still receiving, the update is refused, while the engine loads, its "
            "weights are unknown and the server stops serving"
        ),
    )
    allowed_dirs: tuple[Path, ...] = field(
        default=(),
        metadata=flag(
            "a folder weight updates may load from (repeatable); a path is resolved "
            "(symlinks, ..) and must lie inside one; PERMISSION_DENIED otherwise "
            "(empty: any folder)",
            name="--weights-allowed-dir",
            metavar="DIR",
        ),
    )

    def __post_init__(self) -> None:
        for value, what in (
            (self.check_timeout_s, "refit check timeout (--refit-check-timeout-s)"),
            (self.timeout_s, "refit timeout (--refit-timeout-s)"),
        ):
            if not value > 0:  # no "off": an unbounded refit call is the hang this prevents
                raise ValueError(f"{what} must be > 0 s, got {value}")


@dataclass(frozen=True)
class ServerConfig:
    # Fields with flag(...) metadata are command-line flags (engine_server.cli).
    listen: str = field(
        default="127.0.0.1:50051",
        metadata=flag("HOST:PORT (port 0 picks one) or unix:PATH"),
    )
    # Listening on a non-loopback address must be asked for explicitly.
    allow_remote: bool = field(
        default=False, metadata=flag("allow listening on a non-loopback address")
    )
    tls: TlsConfig | None = None
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    limits: Limits = field(default_factory=Limits)
    grace_period_s: float = field(
        default=10.0,
        metadata=flag("on SIGTERM, how long requests in flight may finish, seconds"),
    )
    kv_replay_batches: int = field(
        default=10_000,
        metadata=flag("KV-event batches kept for subscribers resuming by sequence number"),
    )
    # Blocks per message when a KV snapshot is sent: small enough that encoding
    # one part never holds the event loop long (each part yields to it).
    kv_snapshot_chunk_blocks: int = 256
    # How often the engine's health is polled once serving.
    health_poll_interval_s: float = 2.0
    # Finished request ids remembered, so Abort can answer ALREADY_FINISHED.
    finished_ids_remembered: int = 16_384
    # Watchdog on streams: the longest one write may wait on a client that does
    # not read before the call is ended (ABORTED) and its engine request aborted;
    # also the longest a streamed weight update may go without its next message.
    # None: no bound.
    stream_write_timeout_s: float | None = field(
        default=30.0,
        metadata=flag(
            "abort a stream whose client has not read for this long, seconds; 0 disables",
            off=True,
        ),
    )
    # Generates streams under load: once this many completions run on one stream,
    # its writer waits delta_hold_ms after each write, so that a completion's tokens
    # merge into fewer, larger deltas (fewer messages here, fewer chunks for every
    # process downstream: bridge, Dynamo's frontend, the client). Below that, or
    # at 0 ms, every write goes out at once. Rollouts streams never wait.
    delta_hold_ms: float = field(
        default=2.0,
        metadata=flag(
            "on a Generates stream running --delta-hold-from completions or more, wait "
            "this long after each write so tokens merge into fewer deltas; 0 disables"
        ),
    )
    delta_hold_from: int = field(
        default=8,
        metadata=flag(
            "completions running on one Generates stream from which --delta-hold-ms applies"
        ),
    )
    start_paused: bool = field(
        default=False,
        metadata=flag(
            "start with generation paused: requests wait until a trainer's weight "
            "update and ResumeGeneration (an engine restarted mid-training then never "
            "serves weights older than the trainer's)"
        ),
    )
    # Prometheus metrics at http://HOST:PORT/metrics (0: any free port; None: off),
    # HOST being the gRPC listener's (loopback for a unix socket), so that metrics
    # are reachable from elsewhere only where the contract is (allow_remote).
    metrics_port: int | None = field(
        default=None,
        metadata=flag(
            "serve Prometheus metrics at http://HOST:PORT/metrics, HOST being --listen's "
            "(loopback for a unix socket: remote only where --allow-remote let --listen be); "
            "0 picks a free port (default: off)",
            type=port,
            metavar="PORT",
        ),
    )
    refit: RefitConfig = field(default_factory=RefitConfig)

    def __post_init__(self) -> None:
        """The same checks for ``serve(backend, ServerConfig(...))`` as for the CLI."""
        listen = parse_listen_address(self.listen)  # ValueError naming the problem
        if not listen.is_loopback() and not self.allow_remote:
            raise ValueError(
                f"refusing to listen on non-loopback address {self.listen!r}: the contract "
                "carries no authentication beyond TLS client certificates; pass allow_remote "
                "(--allow-remote) to do it anyway"
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics port must be in 0..65535, got {self.metrics_port}")
        if self.grace_period_s < 0:
            raise ValueError(f"grace period must be >= 0 s, got {self.grace_period_s}")
        if self.stream_write_timeout_s is not None and not self.stream_write_timeout_s > 0:
            raise ValueError(
                "stream write timeout must be > 0 s, or None for no watchdog, got "
                f"{self.stream_write_timeout_s}"
            )
        if self.delta_hold_ms < 0:
            raise ValueError(f"delta hold must be >= 0 ms, got {self.delta_hold_ms}")
        if self.delta_hold_from < 1:
            raise ValueError(
                f"delta hold threshold must be >= 1 completion, got {self.delta_hold_from}"
            )
        for name in (
            "kv_replay_batches",
            "kv_snapshot_chunk_blocks",
            "finished_ids_remembered",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.health_poll_interval_s > 0:
            raise ValueError(
                f"health poll interval must be > 0 s, got {self.health_poll_interval_s}"
            )
        if self.tls is not None and self.tls.client_ca_file is not None and not self.tls.cert_file:
            raise ValueError("a client CA needs the server's own certificate and key")
