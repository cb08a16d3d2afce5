"""Scripted HTTP servers on loopback for client tests (a real aiohttp server, answers chosen by the test)."""

from aiohttp import web


async def serve_on_loopback(path: str, handler) -> tuple[web.AppRunner, str]:
    """Serve POST `path` with `handler` on 127.0.0.1; returns the runner (`await runner.cleanup()` stops it)
    and the address."""
    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()  # the kernel's port, bound at once: no one can take it first
    port = runner.addresses[0][1]
    return runner, f"127.0.0.1:{port}"
