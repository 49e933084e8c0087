"""`serve_engine` on stories260K with a fault hook, for test_faults' process-level checks.

usage: serve_with_fault.py MODEL PORT_FILE [--sticky-at N] [--step-sleep S] [--shutdown-timeout S]
Binds 127.0.0.1 on a free port, writes the port to PORT_FILE and serves; --sticky-at raises CUDA's
"illegal memory access" on the N-th batch, --step-sleep makes every batch take S seconds longer."""
import argparse
import sys
import time

from uacompile.runtime.engine import Engine, EngineConfig
from uacompile.runtime.server import listen_socket, serve_engine


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("port_file")
    p.add_argument("--sticky-at", type=int, default=None)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--shutdown-timeout", type=float, default=30.0)
    a = p.parse_args()
    sock = listen_socket("127.0.0.1", 0)
    engine = Engine(a.model, EngineConfig(cpu_threads=1), max_num_seqs=8)
    calls = [0]

    def hook(batch):
        calls[0] += 1
        if a.sticky_at is not None and calls[0] == a.sticky_at:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if a.step_sleep:
            time.sleep(a.step_sleep)

    engine.on_execute = hook
    with open(a.port_file, "w") as f:
        f.write(str(sock.getsockname()[1]))
    serve_engine(engine, sock, "stories260K", shutdown_timeout=a.shutdown_timeout, log_level="warning")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # noqa: BLE001  (what the CLI does: one line, non-zero)
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
