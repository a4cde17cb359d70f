"""What the tests, the benchmark and the scripts share to build, start and drive
the real thing: model folders, processes, ports, waits.

One module per concern, imported as ``harness.<module>`` (this package itself
imports nothing, so ``harness.procs`` costs no gRPC import):

- ``tiny_model``  the tiny offline model (build it, or get the cached folder)
- ``ports``       free ports, and the one below 32768 Dynamo's system port needs
- ``env``         environments for child processes: Dynamo on loopback, blocked imports, /health
- ``procs``       subprocesses with a role and a log, a group that stops them in reverse
- ``waits``       polling until something holds, raising ``WaitTimeout`` when it does not
- ``http``        the frontend over HTTP: JSON calls, raw SSE streams, load through it
- ``engine``      an engine server over gRPC: in-process servers, load, health, KV snapshot
- ``stack``       engine servers, bridges and a frontend started together for one test
- ``cluster``     real etcd and NATS servers for Dynamo's cluster mode
- ``nemo_rl``     NeMo RL's managed runtime: its worker command line and environment, its rollouts
- ``skyrl``       SkyRL's released client from ``.skyrl/`` (``make skyrl-deps``), imported on 3.11
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Built models and measured figures (git-ignored).
ARTIFACTS = ROOT / ".artifacts"
