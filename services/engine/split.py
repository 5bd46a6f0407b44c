"""`kvmesh engine serve --tensor-parallel N --expert-parallel M`: one engine over N x M ranks.

Every rank loads its share of a DeepSeek V4 or V4.1 checkpoint and builds an Engine over it; rank 0
serves EngineService over gRPC as a single engine does (the mesh sees one engine), through a
lockstep.Leader, and the others follow it (core/lockstep.py, docs/design.md §15). The ranks
are started here (ranks.run), or each process is one rank of an external launcher's group.

A rank that fails takes the engine down: rank 0 ends its process when a collective fails,
so its clients' calls end UNAVAILABLE and the gateway sends them elsewhere; the starting
process then ends the remaining ranks and exits non-zero. SIGTERM to the starting process
stops rank 0 as it stops a single engine (drain, stop), which releases the others.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("kvmesh.engine")
BROKEN_EXIT = 3          # rank 0's exit status when another rank is gone


def serve(args, tp: int, ep: int) -> int:
    """Check what can be checked before any rank starts, then run the ranks."""
    from kvmesh.checkpoint_dir import is_v41
    from kvmesh.services.engine import ranks
    from kvmesh.services.engine.build import choose_model
    from kvmesh.services.engine.model.deepseek_v4.checkpoint import tensor_files
    from kvmesh.services.engine.model.deepseek_v4.config import read_config
    from kvmesh.services.engine.model.deepseek_v4.parallel import Split
    from kvmesh.services.engine.model.deepseek_v4.v41_config import read_v41_config

    choose_model(args)
    read = read_v41_config if is_v41(args.model) else read_config
    Split(tp, ep, 0).check(read(args.model))
    tensor_files(Path(args.model))      # a shard the index lists but the directory lacks
    ranks.run(_rank, (args,), tp, ep)
    return 0


def _rank(split, args) -> None:
    import torch

    from kvmesh.services.engine.build import build_core
    from kvmesh.services.engine.cli import serve_threads
    from kvmesh.services.engine.core import lockstep
    from kvmesh.services.engine.rpc.server import serve as serve_grpc

    local = split.world if "LOCAL_WORLD_SIZE" not in os.environ else \
        int(os.environ["LOCAL_WORLD_SIZE"])
    torch.set_num_threads(max(1, serve_threads(args.threads) // local))
    engine = build_core(args, split)
    if split.rank != 0:
        lockstep.follow(engine)
        return
    leader = lockstep.Leader(engine, on_broken=_end)
    asyncio.run(serve_grpc(leader, f"{args.host}:{args.port}", args.engine_id, args.advertise,
                           args.directory, args.kvstore, args.swa_fetch,
                           args.fetch_deadline_ms / 1000, args.metrics_port))
    leader.stop()


def _end(exc: BaseException) -> None:
    """Rank 0 when another rank is gone: no step can run any more, so the process ends."""
    log.critical("a rank of this engine failed (%s); the engine stops", exc)
    sys.stderr.flush()
    os._exit(BROKEN_EXIT)
