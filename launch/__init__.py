"""How our programs are started, shared by both processes and the launchers.

- ``config_flags``: command-line flags from config dataclass fields (both
  programs' parsers, and the bridge's command line written back from a config);
- ``bridge_command``: the flags a supervisor gives the bridge, as a dataclass
  (``BridgeLaunch``, the base of ``bridge.config.BridgeConfig``), and its
  command line and environment;
- ``supervisor``: child processes kept running (restarts, draining, output),
  for ``engine_server.host`` and ``engine_worker``;
- ``parent_death``: children that end with their parent, both sides of it.
- ``stop_signals``: SIGTERM and SIGINT that stop a program cleanly, and never
  kill it once it has stopped (``engine_server`` and ``engine_worker``).

It imports neither side (no dynamo, vllm, torch, ``bridge`` or
``engine_server``), so that each side, and a launcher importing neither, can
import it.
"""
