"""The ``pdplug proxy`` command (registered in the ``pdplug.cli`` entry-point group)."""

from __future__ import annotations

import click

from pdplug.adapters.room_ids import MAX_ALLOCATOR_ID

__all__ = ["proxy"]


@click.command()
@click.option("--prefill", "prefill_url", required=True, help="Prefill engine URL (http://h:p).")
@click.option("--decode", "decode_url", required=True, help="Decode engine URL (http://h:p).")
@click.option(
    "--mode",
    type=click.Choice(["push", "pull"]),
    default="push",
    show_default=True,
    help="push: PdplugConnector (both requests at once); pull: vLLM's NixlConnector.",
)
@click.option("--prefill-instance", default="", help="Prefill engine's pdplug instance (push).")
@click.option("--bootstrap", default="", help="Prefill rendezvous tcp://host:port (push).")
@click.option("--decode-instance", default="", help="Decode engine's pdplug instance (push).")
@click.option(
    "--allocator-id",
    type=click.IntRange(0, MAX_ALLOCATOR_ID),
    default=0,
    show_default=True,
    help="Room allocator id; give every proxy replica in front of the same engines its own.",
)
@click.option(
    "--timeout-s",
    type=click.FloatRange(0.1, 86400),
    default=600.0,
    show_default=True,
    help="Upper bound of one upstream request (seconds): an engine that accepts and never "
    "answers fails the request with 502 after this long (size it to the longest generation).",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
def proxy(
    prefill_url: str,
    decode_url: str,
    mode: str,
    prefill_instance: str,
    bootstrap: str,
    decode_instance: str,
    allocator_id: int,
    timeout_s: float,
    host: str,
    port: int,
) -> None:
    """OpenAI-compatible proxy in front of a vLLM prefill engine and a vLLM decode engine."""
    import importlib.util

    missing = [m for m in ("httpx", "fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise click.ClickException(
            f"pdplug proxy needs {', '.join(missing)}: pip install 'pdplug[vllm]'"
        )
    from pdplug_vllm.proxy import ProxyConfig, serve

    try:
        config = ProxyConfig(
            prefill_url=prefill_url,
            decode_url=decode_url,
            mode=mode,
            prefill_instance=prefill_instance,
            bootstrap=bootstrap,
            decode_instance=decode_instance,
            allocator_id=allocator_id,
            timeout_s=timeout_s,
        )
    except ValueError as e:
        # name the command-line options, not the config fields
        msg = str(e).replace("prefill_instance", "--prefill-instance")
        raise click.BadParameter(msg.replace("and bootstrap", "and --bootstrap")) from None
    serve(config, host=host, port=port)
