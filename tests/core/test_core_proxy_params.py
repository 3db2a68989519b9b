"""``pdplug proxy`` checks a request's own ``kv_transfer_params`` before forwarding (issue 22).

A malformed or contradictory one gets HTTP 400 within 1 s, in the engines' guard format
(:func:`pdplug.adapters.vllm.guard.error_document`: ``param`` the field, ``message`` the value,
cut when huge) and reaches neither engine; a well-formed one goes through as before (the
proxy's own ``kv_transfer_params`` in place of the client's, every other key unchanged).

Real HTTP on 127.0.0.1: the proxy (push and pull mode) in front of two tiny recording
backends, each a uvicorn server that keeps every body it receives. The proxy is under test,
not an engine, so the backends answer with canned JSON.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from fastapi import FastAPI, Request  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pdplug.adapters.room_ids import ROOM_LIMIT  # noqa: E402
from pdplug.adapters.vllm.guard import error_document  # noqa: E402
from pdplug.adapters.vllm.params import (  # noqa: E402
    MAX_MESSAGE_CHARS,
    MAX_NAME_CHARS,
    ParamsError,
    check_request_params,
)
from pdplug.ports import free_ports  # noqa: E402
from pdplug_vllm.proxy import ProxyConfig, make_app  # noqa: E402

PREFILL_INSTANCE, BOOTSTRAP = "prefill-0", "tcp://127.0.0.1:5999"
#: what the pull-mode prefill backend returns in its answer (NixlConnector's shape)
PULL_ANSWER = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "e0",
    "remote_block_ids": [1, 2],
    "remote_host": "127.0.0.1",
    "remote_port": 7,
}
PATHS = ("/v1/completions", "/v1/chat/completions")


def _serve(app: Any, port: int) -> Any:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    return server


def _recording_backend(seen: list[tuple[str, dict[str, Any]]]) -> Any:
    """Keeps (path, body) of every POST; answers like an engine that served it."""
    app = FastAPI()

    async def answer(path: str, request: Request) -> dict[str, Any]:
        body = await request.json()
        seen.append((path, body))
        return {"choices": [{"text": "ok"}], "kv_transfer_params": PULL_ANSWER}

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        return await answer("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        return await answer("/v1/chat/completions", request)

    return app


class Rig:
    """Two recording backends and one proxy per mode, all on loopback."""

    def __init__(self) -> None:
        p_port, d_port, push_port, pull_port = free_ports(4)
        self.prefill_seen: list[tuple[str, dict[str, Any]]] = []
        self.decode_seen: list[tuple[str, dict[str, Any]]] = []
        self.servers = [
            _serve(_recording_backend(self.prefill_seen), p_port),
            _serve(_recording_backend(self.decode_seen), d_port),
        ]
        urls = {
            "prefill_url": f"http://127.0.0.1:{p_port}",
            "decode_url": f"http://127.0.0.1:{d_port}",
        }
        push = ProxyConfig(
            **urls,
            mode="push",
            prefill_instance=PREFILL_INSTANCE,
            bootstrap=BOOTSTRAP,
            timeout_s=20,
        )
        pull = ProxyConfig(**urls, mode="pull", timeout_s=20)
        self.servers += [_serve(make_app(push), push_port), _serve(make_app(pull), pull_port)]
        self.proxy = {
            "push": f"http://127.0.0.1:{push_port}",
            "pull": f"http://127.0.0.1:{pull_port}",
        }
        self.client = httpx.Client(timeout=20)

    def clear(self) -> None:
        self.prefill_seen.clear()
        self.decode_seen.clear()

    def close(self) -> None:
        self.client.close()
        for s in self.servers:
            s.should_exit = True


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    r = Rig()
    try:
        yield r
    finally:
        r.close()


# --- what a client can send -------------------------------------------------------------

_json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
_json = st.recursive(
    _json_leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=8), kids, max_size=3)
    ),
    max_leaves=6,
)
_not_bool = _json.filter(lambda v: v is not None and not isinstance(v, bool))
_not_str = _json.filter(lambda v: not isinstance(v, str))
_not_int = _json.filter(lambda v: not isinstance(v, int) or isinstance(v, bool))
_name = st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=1, max_size=12)
_bootstrap = st.builds(
    lambda h, p: f"tcp://{h}:{p}", st.sampled_from(["127.0.0.1", "node-3"]), st.integers(1, 65535)
)
_room = st.integers(0, ROOM_LIMIT - 1)
_bad_room = st.one_of(st.integers(-(2**70), -1), st.integers(ROOM_LIMIT, 2**80))
_foreign = st.dictionaries(
    st.sampled_from(["remote_engine_id", "remote_host", "x"]), _json, max_size=2
)
_DEC_FLAGS = {"do_remote_prefill": True, "do_remote_decode": False}
_PRE_FLAGS = {"do_remote_decode": True, "do_remote_prefill": False}
_F = "kv_transfer_params"
_P = f"{_F}.pdplug"


def _dec_doc() -> Any:
    return st.fixed_dictionaries(
        {"room": _room, "prefill_instance": _name, "bootstrap": _bootstrap}
    )


def _with(doc: Any, key: str, value: Any) -> Any:
    return st.tuples(doc, value).map(lambda dv: {**dv[0], key: dv[1]})


def _bad_decode_doc() -> Any:
    """(pdplug document, field named) a decode request must not carry."""
    dec = _dec_doc()
    huge = st.integers(MAX_NAME_CHARS + 1, 100_000).map(lambda n: "p" * n)
    return st.one_of(
        _with(dec, "room", _bad_room).map(lambda d: (d, f"{_P}.room")),
        _with(dec, "room", _not_int).map(lambda d: (d, f"{_P}.room")),
        _with(dec, "prefill_instance", _not_str).map(lambda d: (d, f"{_P}.prefill_instance")),
        _with(dec, "prefill_instance", huge).map(lambda d: (d, f"{_P}.prefill_instance")),
        _with(dec, "bootstrap", _not_str).map(lambda d: (d, f"{_P}.bootstrap")),
        _with(
            dec, "bootstrap", st.text(max_size=30).filter(lambda s: not s.startswith("tcp://"))
        ).map(lambda d: (d, f"{_P}.bootstrap")),
        _with(dec, "bootstrap", st.integers(65536, 10**6).map(lambda p: f"tcp://h:{p}")).map(
            lambda d: (d, f"{_P}.bootstrap")
        ),
        st.tuples(dec, st.sampled_from(["room", "prefill_instance", "bootstrap"])).map(
            lambda dk: ({k: v for k, v in dk[0].items() if k != dk[1]}, _P)
        ),
        _with(dec, "rank", _json).map(lambda d: (d, _P)),  # unknown field
        _json.filter(lambda v: not isinstance(v, dict)).map(lambda v: (v, _P)),
    )


def _bad_prefill_doc() -> Any:
    pre = st.fixed_dictionaries({"room": _room}, optional={"decode_instance": _name})
    return st.one_of(
        _with(pre, "room", _bad_room).map(lambda d: (d, f"{_P}.room")),
        _with(pre, "room", _not_int).map(lambda d: (d, f"{_P}.room")),
        _with(pre, "decode_instance", _not_str).map(lambda d: (d, f"{_P}.decode_instance")),
        _with(pre, "bootstrap", _json).map(lambda d: (d, _P)),  # a decode-side key: unknown
        st.just(({}, _P)),
    )


#: (kv_transfer_params, the field the 400 must name)
MALFORMED = st.one_of(
    _json.filter(lambda v: v is not None and not isinstance(v, dict)).map(lambda v: (v, _F)),
    st.tuples(st.sampled_from(["do_remote_prefill", "do_remote_decode"]), _not_bool).map(
        lambda fv: ({fv[0]: fv[1]}, f"{_F}.{fv[0]}")
    ),
    st.integers(1000, 200_000).map(
        lambda n: ({"do_remote_decode": "y" * n}, f"{_F}.do_remote_decode")
    ),
    _dec_doc().map(
        lambda d: ({"do_remote_prefill": True, "do_remote_decode": True, "pdplug": d}, _F)
    ),
    st.tuples(
        _dec_doc(), st.sampled_from([{}, {"do_remote_prefill": False}, {"do_remote_decode": False}])
    ).map(lambda df: ({**df[1], "pdplug": df[0]}, _P)),
    _foreign.map(lambda f: ({**f, "do_remote_prefill": True}, _P)),
    _bad_decode_doc().map(lambda df: ({**_DEC_FLAGS, "pdplug": df[0]}, df[1])),
    _bad_prefill_doc().map(lambda df: ({**_PRE_FLAGS, "pdplug": df[0]}, df[1])),
)

#: kv_transfer_params the checks pass: forwarded as before
WELL_FORMED = st.one_of(
    st.none(),
    _foreign,
    st.tuples(
        _foreign, st.sampled_from([{"do_remote_prefill": False}, {"do_remote_decode": False}])
    ).map(lambda t: {**t[0], **t[1]}),
    _dec_doc().map(lambda d: {**_DEC_FLAGS, "pdplug": d}),
    st.fixed_dictionaries({"room": _room}, optional={"decode_instance": _name}).map(
        lambda d: {**_PRE_FLAGS, "pdplug": d}
    ),
)

_SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
    ],
)


def _body(path: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "max_tokens": 3, "temperature": 0.0, "stream": stream}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = [1, 2, 3]
    return body


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["push", "pull"])
@_SETTINGS
@given(case=MALFORMED, path=st.sampled_from(PATHS), stream=st.booleans())
def test_proxy_refuses_malformed_kv_transfer_params_before_forwarding(
    rig: Rig, mode: str, case: tuple[Any, str], path: str, stream: bool
) -> None:
    params, field = case
    with pytest.raises(ParamsError) as refused:  # the engines' own check refuses it too
        check_request_params(params)
    assert refused.value.field == field, (params, refused.value.field)
    rig.clear()
    t0 = time.monotonic()
    r = rig.client.post(rig.proxy[mode] + path, json={**_body(path, stream), _F: params})
    took = time.monotonic() - t0
    assert r.status_code == 400, (r.status_code, r.text)
    assert took < 1.0, took
    doc = r.json()
    assert doc == error_document(refused.value), doc  # KVParamsGuard's document, byte for byte
    err = doc["error"]
    assert err["param"] == field and err["type"] == "BadRequestError" and err["code"] == 400
    assert err["message"].startswith(_F), err["message"]
    assert len(err["message"]) <= MAX_MESSAGE_CHARS, len(err["message"])
    assert not rig.prefill_seen and not rig.decode_seen, "a refused request reached an engine"


def test_a_huge_value_is_shown_cut() -> None:
    """The value a client sent is in the message (to find the mistake), cut when huge."""
    with pytest.raises(ParamsError) as e:
        check_request_params({"do_remote_prefill": "yes"})
    assert str(e.value) == "kv_transfer_params.do_remote_prefill='yes' is not a boolean"
    with pytest.raises(ParamsError) as e:
        check_request_params({"do_remote_prefill": "y" * 100_000})
    msg = str(e.value)
    assert msg.startswith("kv_transfer_params.do_remote_prefill='yyyy")
    assert msg.endswith("(100056 characters)") and len(msg) <= MAX_MESSAGE_CHARS, msg[-80:]
    with pytest.raises(ParamsError) as e:
        check_request_params(
            {
                **_DEC_FLAGS,
                "pdplug": {"room": -3, "prefill_instance": "p", "bootstrap": "tcp://h:1"},
            }
        )
    assert e.value.field == f"{_P}.room" and "room=-3" in str(e.value)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["push", "pull"])
@_SETTINGS
@given(params=WELL_FORMED, path=st.sampled_from(PATHS), stream=st.booleans())
def test_proxy_forwards_well_formed_kv_transfer_params_as_before(
    rig: Rig, mode: str, params: Any, path: str, stream: bool
) -> None:
    check_request_params(params)  # the strategy makes only what the engines accept
    client_body = _body(path, stream)
    if params is not None:
        client_body[_F] = params
    rig.clear()
    r = rig.client.post(rig.proxy[mode] + path, json=client_body)
    assert r.status_code == 200, (r.status_code, r.text)
    assert len(rig.prefill_seen) == 1 and len(rig.decode_seen) == 1
    (p_path, p_body), (d_path, d_body) = rig.prefill_seen[0], rig.decode_seen[0]
    assert p_path == d_path == path
    # the prefill request: the client's, cut to one token, with the proxy's params
    p_params = p_body.pop(_F)
    expect_p = {**client_body, "max_tokens": 1, "stream": False}
    expect_p.pop(_F, None)
    assert p_body == expect_p, (p_body, expect_p)
    # the decode request: the client's, every key unchanged but the proxy's params
    d_params = d_body.pop(_F)
    expect_d = dict(client_body)
    expect_d.pop(_F, None)
    assert d_body == expect_d, (d_body, expect_d)
    if mode == "pull":
        assert p_params["do_remote_decode"] is True and d_params == PULL_ANSWER
    else:
        room = p_params["pdplug"]["room"]
        assert p_params == {**_PRE_FLAGS, "pdplug": {"room": room, "decode_instance": ""}}
        assert d_params == {
            **_DEC_FLAGS,
            "pdplug": {"room": room, "prefill_instance": PREFILL_INSTANCE, "bootstrap": BOOTSTRAP},
        }
