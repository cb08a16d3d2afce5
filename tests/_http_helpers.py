"""Scripted HTTP servers on loopback for client tests (a real aiohttp server, answers chosen by the test)."""

from aiohttp import web

from areal_pipeline.utils import find_free_port


async def serve_on_loopback(path: str, handler) -> tuple[web.AppRunner, str]:
    """Serve POST `path` with `handler` on 127.0.0.1; returns the runner (`await runner.cleanup()` stops it)
    and the address."""
    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = find_free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"127.0.0.1:{port}"
