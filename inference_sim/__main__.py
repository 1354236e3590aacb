"""``python -m inference_sim``: serve the simulated pool with uvicorn (one process)."""

from __future__ import annotations

import logging
import socket
import sys
from collections.abc import Sequence

import uvicorn

from inference_sim.app import create_app
from inference_sim.config import parse_config


class _AnnouncingServer(uvicorn.Server):
    """Prints the ready line once the socket is bound (with the real port when --port 0)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit:
            port = self.servers[0].sockets[0].getsockname()[1] if self.servers else self.config.port
            print(f"inference_sim listening on http://{self.config.host}:{port}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    app = create_app(config)
    server = _AnnouncingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            access_log=config.access_log,
            lifespan="on",
            # Open streams must not hold a shutdown for long.
            timeout_graceful_shutdown=2,
        )
    )
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
