"""The official `openai` Python SDK against the real `lily serve` binary.

The server runs the built-in demo checkpoint: the real architecture and
tokenizer with random weights, on the CPU. Its text is gibberish, so tests
check shapes, invariants and determinism rather than wording, except where
the output is forced:

Tool calls and the exact reasoning/content split use the server's test hook
`--test-script-file` (see conftest.py, SCRIPT_RULES). For a prompt containing
a marker such as E2E-TOOL-QUESTION the request still goes through the real
engine (validation, queue, prefill, prefix cache, the `Started` event with
its cached-token count), but the model's tokens are dropped and the scripted
reply is tokenised and streamed in their place. So the whole path after the
model (detokenisation, reasoning split, Qwen XML tool-call parsing, OpenAI
JSON and SSE) is the production one, and so is the chat template that
renders the tool result sent back for the second turn.
"""

import concurrent.futures
import json
import signal
import socket
import time

import openai
import pytest
import requests

from conftest import MODEL, STRICT_KEY, Server

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def user(text):
    return [{"role": "user", "content": text}]


# ------------------------------------------------------------------ basics --


def test_models_says_the_weights_are_random(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    card = models[0].model_dump()
    assert card["synthetic"] is True
    assert "random weights" in card["note"]
    assert client.models.retrieve(MODEL).id == MODEL


def test_plain_chat(client):
    r = client.chat.completions.create(model=MODEL, messages=user("Hello!"), max_tokens=12, extra_body=NO_THINK)
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0


def test_streamed_chat_equals_its_usage(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=user("Stream please"),
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_THINK,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens <= 10
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert len({c.id for c in chunks}) == 1


def test_stream_and_non_stream_agree_under_greedy(client):
    args = dict(model=MODEL, messages=user("Same either way"), max_tokens=16, temperature=0, extra_body=NO_THINK)
    whole = client.chat.completions.create(**args).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **args) if c.choices
    )
    assert whole == streamed


def test_seed_reproducibility(client):
    args = dict(model=MODEL, messages=user("Pick words"), max_tokens=16, temperature=1.0, extra_body=NO_THINK)
    a = client.chat.completions.create(seed=1234, **args).choices[0].message.content
    b = client.chat.completions.create(seed=1234, **args).choices[0].message.content
    c = client.chat.completions.create(seed=98765, **args).choices[0].message.content
    assert a == b
    assert a != c


def test_stop_strings(client):
    args = dict(model=MODEL, messages=user("Say many things"), max_tokens=40, temperature=0, extra_body=NO_THINK)
    full = client.chat.completions.create(**args).choices[0].message.content
    assert len(full) > 8, full
    # A two-character stop string from the middle of the greedy output (not
    # a replacement character, which only marks bytes cut between tokens).
    mid = next(i for i in range(len(full) // 2, len(full) - 1) if "\ufffd" not in full[i : i + 2])
    stop = full[mid : mid + 2]
    expected = full[: full.find(stop)]
    r = client.chat.completions.create(stop=[stop], **args)
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    # A plain string works too.
    assert client.chat.completions.create(stop=stop, **args).choices[0].message.content == expected


def test_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=user("logprobs"), max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, extra_body=NO_THINK
    )
    content = r.choices[0].logprobs.content
    # Every generated token has an entry, except an EOS that ended the reply.
    eos = 1 if r.choices[0].finish_reason == "stop" else 0
    assert len(content) == r.usage.completion_tokens - eos
    for t in content:
        assert t.logprob <= 0
        assert len(t.top_logprobs) == 3
        tops = [x.logprob for x in t.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert abs(t.logprob - tops[0]) < 1e-4
        assert bytes(t.bytes).decode("utf-8", errors="replace") == t.token or "\ufffd" in t.token
    streamed = client.chat.completions.create(
        model=MODEL, messages=user("logprobs"), max_tokens=6, temperature=0, logprobs=True, stream=True, extra_body=NO_THINK
    )
    n = sum(len(c.choices[0].logprobs.content) for c in streamed if c.choices and c.choices[0].logprobs)
    assert n == r.usage.completion_tokens - eos


# ---------------------------------------------------------------- thinking --


def test_thinking_on_by_default_splits_reasoning(client):
    r = client.chat.completions.create(model=MODEL, messages=user("E2E-THINK: what is 2+2?"))
    msg = r.choices[0].message
    assert msg.reasoning_content == "Step one: add.\nStep two: done."
    assert msg.content == "The answer is 4."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens_details.reasoning_tokens > 0


def test_thinking_streamed(client):
    stream = client.chat.completions.create(model=MODEL, messages=user("E2E-THINK: what is 2+2?"), stream=True)
    reasoning, content = "", ""
    for c in stream:
        if c.choices:
            d = c.choices[0].delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
    assert reasoning == "Step one: add.\nStep two: done."
    assert content == "The answer is 4."


def test_thinking_off_is_all_content_from_the_model(client):
    r = client.chat.completions.create(model=MODEL, messages=user("no thinking"), max_tokens=8, extra_body=NO_THINK)
    msg = r.choices[0].message
    assert getattr(msg, "reasoning_content", None) is None
    assert msg.content
    # With thinking on, the random model never closes its think block:
    # everything it writes is reasoning.
    r = client.chat.completions.create(model=MODEL, messages=user("thinking"), max_tokens=8)
    assert r.choices[0].message.reasoning_content


# ------------------------------------------------------------------ tools --


def test_tool_call_round_trip(client):
    messages = user("E2E-TOOL-QUESTION: what is the weather in Paris?")
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.content is None
    assert msg.reasoning_content == "I should call the weather tool."
    (call,) = msg.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}

    # The client runs the tool and sends the result back.
    messages.append(msg.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"})
    r2 = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert r2.choices[0].finish_reason == "stop"
    assert r2.choices[0].message.content == "It is sunny and 21 C in Paris."
    assert not r2.choices[0].message.tool_calls
    # The second prompt begins with the first: the prefix cache serves it.
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens


def test_streamed_tool_call(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=user("E2E-TOOL-QUESTION: Paris?"), tools=TOOLS, stream=True
    )
    calls = {}
    finish = None
    for c in stream:
        if not c.choices:
            continue
        ch = c.choices[0]
        finish = ch.finish_reason or finish
        for tc in ch.delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = tc.id or entry["id"]
            if tc.function.name:
                entry["name"] += tc.function.name
            entry["arguments"] += tc.function.arguments or ""
        assert "<tool_call>" not in (ch.delta.content or "")
    assert finish == "tool_calls"
    assert list(calls) == [0]
    assert calls[0]["id"].startswith("call_")
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 2}


def test_tool_choice_none_and_named_are_accepted(client):
    r = client.chat.completions.create(
        model=MODEL, messages=user("hi"), tools=TOOLS, tool_choice="none", max_tokens=4, extra_body=NO_THINK
    )
    assert not r.choices[0].message.tool_calls
    # A named choice opens the call for the model: even random weights
    # produce a call to that function.
    r = client.chat.completions.create(
        model=MODEL,
        messages=user("hi"),
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=24,
        extra_body=NO_THINK,
    )
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    json.loads(calls[0].function.arguments)  # always a JSON object, even when cut short


# ----------------------------------------------------------- prefix cache --


def test_prefix_reuse_shows_in_cached_tokens(client):
    long_prompt = "E2E prefix reuse. " + " ".join(f"word{i}" for i in range(400))
    args = dict(model=MODEL, messages=user(long_prompt), max_tokens=2, extra_body=NO_THINK)
    first = client.chat.completions.create(**args)
    second = client.chat.completions.create(**args)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 400
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= second.usage.prompt_tokens


# ------------------------------------------------------------- completions --


def test_legacy_completions(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, logprobs=2)
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason in ("stop", "length")
    eos = 1 if r.choices[0].finish_reason == "stop" else 0
    assert len(r.choices[0].logprobs.tokens) == r.usage.completion_tokens - eos
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


# ------------------------------------------------------------ concurrency --


def test_concurrent_streaming_clients(client):
    def one(i):
        stream = client.chat.completions.create(
            model=MODEL,
            messages=user(f"client {i}"),
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_THINK,
        )
        chunks = list(stream)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return finish, chunks[-1].usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    for finish, completion in results:
        assert len(finish) == 1 and finish[0] in ("stop", "length")
        assert 0 < completion <= 12


def test_disconnect_cancels_the_request(main_server):
    base = main_server.base
    before = main_server.metric("lily_engine_requests_cancelled_total")
    body = {"model": MODEL, "messages": user("talk for a long time"), "max_tokens": 5000, "stream": True, **NO_THINK}
    with requests.post(base + "/v1/chat/completions", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith(b"data: "):
                got += 1
            if got >= 4:
                break
    # The connection is closed: the engine must drop the request.
    deadline = time.time() + 20
    while time.time() < deadline:
        if main_server.metric("lily_engine_requests_cancelled_total") > before and main_server.metric("lily_engine_running") == 0:
            break
        time.sleep(0.1)
    assert main_server.metric("lily_engine_requests_cancelled_total") > before
    assert main_server.metric("lily_engine_running") == 0
    assert main_server.metric("lily_client_disconnects_total") >= 1

    # A non-streamed request whose client gives up is cancelled too.
    before = main_server.metric("lily_engine_requests_cancelled_total")
    body["stream"] = False
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(base + "/v1/chat/completions", json=body, timeout=1)
    deadline = time.time() + 20
    while time.time() < deadline and main_server.metric("lily_engine_requests_cancelled_total") == before:
        time.sleep(0.1)
    assert main_server.metric("lily_engine_requests_cancelled_total") > before
    assert main_server.metric("lily_engine_running") == 0


# ------------------------------------------------------------------ errors --


def expect_status(exc_type, status, fn):
    with pytest.raises(exc_type) as info:
        fn()
    assert info.value.status_code == status
    body = info.value.body
    assert isinstance(body, dict) and body.get("message"), body
    return info.value


def test_invalid_requests_are_400_in_openai_format(client):
    def chat(**kw):
        kw.setdefault("messages", user("x"))
        return lambda: client.chat.completions.create(model=MODEL, **kw)

    cases = [
        (dict(n=2), "n"),
        (dict(temperature=5), "temperature"),
        (dict(top_logprobs=3), "top_logprobs"),
        (dict(logprobs=True, top_logprobs=30), "top_logprobs"),
        (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(messages=[]), "messages"),
        (dict(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
        (dict(extra_body={"not_a_field": 1}), "not_a_field"),
        (dict(response_format={"type": "json_object"}), "response_format.type"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice.function.name"),
        (dict(tool_choice="required"), "tool_choice"),
    ]
    for kwargs, param in cases:
        err = expect_status(openai.BadRequestError, 400, chat(**kwargs))
        assert err.body["param"] == param, (kwargs, err.body)
        assert err.body["type"] == "invalid_request_error"
    expect_status(openai.NotFoundError, 404, lambda: client.chat.completions.create(model="gpt-4o", messages=user("x")))


def test_http_level_errors(main_server):
    base = main_server.base
    r = requests.get(base + "/v1/nope", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = requests.get(base + "/v1/chat/completions", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["message"]
    r = requests.post(base + "/v1/chat/completions", data="{broken", headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_auth(strict_server):
    from openai import OpenAI

    bad = OpenAI(base_url=strict_server.base + "/v1", api_key="wrong", max_retries=0)
    expect_status(openai.AuthenticationError, 401, lambda: bad.models.list())
    assert requests.get(strict_server.base + "/v1/models", timeout=10).status_code == 401
    assert requests.get(strict_server.base + "/health", timeout=10).status_code == 200
    good = OpenAI(base_url=strict_server.base + "/v1", api_key=STRICT_KEY, max_retries=0)
    assert good.models.list().data[0].id == MODEL


def test_cors_when_enabled(strict_server, main_server):
    headers = {"Origin": "http://example.test", "Access-Control-Request-Method": "POST"}
    r = requests.options(strict_server.base + "/v1/chat/completions", headers=headers, timeout=10)
    assert r.headers.get("access-control-allow-origin") == "*"
    r = requests.options(main_server.base + "/v1/chat/completions", headers=headers, timeout=10)
    assert "access-control-allow-origin" not in r.headers


def test_limits(strict_client, strict_server):
    # Body size (413).
    r = requests.post(
        strict_server.base + "/v1/chat/completions",
        json={"model": MODEL, "messages": user("x" * 5000)},
        headers={"Authorization": f"Bearer {STRICT_KEY}"},
        timeout=10,
    )
    assert r.status_code == 413 and r.json()["error"]["message"]
    # Number of messages.
    many = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 3
    err = expect_status(openai.BadRequestError, 400, lambda: strict_client.chat.completions.create(model=MODEL, messages=many))
    assert err.body["code"] == "too_many_messages"
    # Prompt longer than the context (--max-seq 512).
    long = " ".join(f"w{i}" for i in range(600))
    err = expect_status(
        openai.BadRequestError, 400, lambda: strict_client.chat.completions.create(model=MODEL, messages=user(long))
    )
    assert err.body["code"] == "context_length_exceeded"
    # max_tokens beyond what the context leaves.
    err = expect_status(
        openai.BadRequestError,
        400,
        lambda: strict_client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=600),
    )
    assert err.body["param"] == "max_tokens"


def test_request_deadline(strict_client):
    # --request-timeout-s 1, and far more tokens than the CPU makes in 1 s.
    err = expect_status(
        openai.APIStatusError,
        504,
        lambda: strict_client.chat.completions.create(model=MODEL, messages=user("go on"), max_tokens=480, extra_body=NO_THINK),
    )
    assert err.body["code"] == "timeout"


def test_full_server_says_429_with_retry_after(strict_server):
    # --max-concurrent 1 --max-queue 1: one generating, one waiting, the
    # third is refused. The first two end at the 1 s deadline.
    headers = {"Authorization": f"Bearer {STRICT_KEY}"}
    body = {"model": MODEL, "messages": user("busy"), "max_tokens": 400, "stream": True, **NO_THINK}
    # Start from an idle server: a request of an earlier test that ended at
    # its deadline may hold the one slot until the engine's next step.
    deadline = time.time() + 30
    while time.time() < deadline:
        h = requests.get(strict_server.base + "/health", timeout=5).json()
        if h["running"] + h["waiting"] == 0:
            break
        time.sleep(0.05)
    held = []
    try:
        for n in range(2):
            r = requests.post(strict_server.base + "/v1/chat/completions", json=body, headers=headers, stream=True, timeout=30)
            assert r.status_code == 200
            held.append(r)
            # The response starts before the engine admits the request; the
            # next one is sent once this one holds the generating slot (else
            # both sit in the one-place queue and the second gets 429).
            deadline = time.time() + 10
            while n == 0 and time.time() < deadline:
                if requests.get(strict_server.base + "/health", timeout=5).json()["running"] >= 1:
                    break
                time.sleep(0.02)
        deadline = time.time() + 10
        while time.time() < deadline:
            h = requests.get(strict_server.base + "/health", timeout=5).json()
            if h["running"] + h["waiting"] >= 2:
                break
            time.sleep(0.05)
        r = requests.post(strict_server.base + "/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        for r in held:
            r.close()


# ---------------------------------------------------------------- shutdown --


def test_sigterm_drains_in_flight_requests(cache_dir, log_dir, main_server):
    server = Server("drain", [], cache_dir, log_dir)
    try:
        body = {"model": MODEL, "messages": user("drain me"), "max_tokens": 60, "stream": True, "temperature": 0, **NO_THINK}
        with requests.post(server.base + "/v1/chat/completions", json=body, stream=True, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith(b"data: "))
            assert b"assistant" in first
            server.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith(b"data: ")]
        assert rest[-1] == b"data: [DONE]", rest[-3:]
        finishes = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in rest[:-1]]
        assert finishes[-1] in ("stop", "length")
        assert server.proc.wait(timeout=30) == 0
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", server.port), timeout=2)
        assert "draining" in server.log_text()
    finally:
        server.stop()
