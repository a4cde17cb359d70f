"""The engine server's own settings, independent of the backend."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from engine_server.addresses import parse_listen_address


@dataclass(frozen=True)
class GenerationDefaults:
    """The launch-time generation config rollouts are sampled with (NeMo RL's).

    An empty ``stop_token_ids`` means "the model's EOS ids", filled in once the
    engine has reported them. ``stop_strings`` apply to every rollout, merged
    with the rollout's own; ``bad_words`` only on engines that support them.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 512
    stop_token_ids: tuple[int, ...] = ()
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

    max_stop_strings: int = 32
    max_stop_string_length: int = 1024
    max_request_id_length: int = 256
    max_message_bytes: int = 64 * 1024 * 1024
    max_top_logprobs: int = 20
    # Admission: over these a request fails alone with RESOURCE_EXHAUSTED naming
    # the limit (retryable), and the server's memory stays bounded whatever a
    # client sends. Sized for RL batches of many thousand concurrent rollouts.
    max_requests_in_flight: int = 16_384
    max_rollouts_per_stream: int = 16_384
    max_starts_per_message: int = 4_096
    # Refuse new requests while the engine has this many waiting (0: never).
    max_waiting_requests: int = 0
    max_kv_subscribers: int = 64

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            low = 0 if f.name == "max_waiting_requests" else 1
            if getattr(self, f.name) < low:
                raise ValueError(f"limit {f.name} must be >= {low}, got {getattr(self, f.name)}")


@dataclass(frozen=True)
class TlsConfig:
    """Server certificate, and client CAs when clients must present certificates."""

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None


@dataclass(frozen=True)
class RefitConfig:
    """Bounds on the refit cycle: no refit call holds the refit lock (and so the
    pause, every rollout waiting at the gate) for good."""

    # Reading a checkpoint folder's headers before anything loads (a hung mount):
    # past it the update is refused, the old weights still serve.
    check_timeout_s: float = 60.0
    # Any one refit call's engine work: a path load, a streamed update from its
    # manifest to its commit, each weight-transfer phase.
    timeout_s: float = 1800.0
    # Folders a weight update may load from (a path resolved, symlinks and ``..``
    # followed, must lie inside one); empty: any.
    allowed_dirs: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        for value, what in (
            (self.check_timeout_s, "refit check timeout (--refit-check-timeout-s)"),
            (self.timeout_s, "refit timeout (--refit-timeout-s)"),
        ):
            if not value > 0:  # no "off": an unbounded refit call is the hang this prevents
                raise ValueError(f"{what} must be > 0 s, got {value}")


@dataclass(frozen=True)
class ServerConfig:
    # host:port ("127.0.0.1:0" picks a free port) or unix:PATH.
    listen: str = "127.0.0.1:50051"
    # Listening on a non-loopback address must be asked for explicitly.
    allow_remote: bool = False
    tls: TlsConfig | None = None
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    limits: Limits = field(default_factory=Limits)
    # On stop: how long requests in flight may run on before they are aborted.
    grace_period_s: float = 10.0
    # KV-event batches kept for subscribers resuming by sequence number.
    kv_replay_batches: int = 10_000
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
    stream_write_timeout_s: float | None = 30.0
    # Generates streams under load: once this many completions run on one stream,
    # its writer waits delta_hold_ms after each write, so that a completion's tokens
    # merge into fewer, larger deltas (fewer messages here, fewer chunks for every
    # process downstream: bridge, Dynamo's frontend, the client). Below that, or
    # at 0 ms, every write goes out at once. Rollouts streams never wait.
    delta_hold_ms: float = 2.0
    delta_hold_from: int = 8
    # Generation paused from the start (PauseGeneration WAIT): requests wait for
    # a trainer's update and ResumeGeneration.
    start_paused: bool = False
    # Prometheus metrics at http://HOST:PORT/metrics (0: any free port; None: off),
    # HOST being the gRPC listener's (loopback for a unix socket), so that metrics
    # are reachable from elsewhere only where the contract is (allow_remote).
    metrics_port: int | None = None
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
