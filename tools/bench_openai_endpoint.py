"""Cost of the OpenAI-compatible endpoint itself: one completion's round trip at turns 1, 100 and 300.

Run: ``t1async bench openai-endpoint [--turns 300] [--rounds 3]``. Prints ONE JSON object.
With ``--dialects``: the overhead per dialect instead (:func:`dialects`, below).

The real surface (t1async/rollout/endpoint/: FastAPI + uvicorn, the recorder, the shipped
tokenizer and template) called over one keep-alive HTTP connection with the JSON an OpenAI client
sends (not the ``openai`` client itself: its own request building costs about as much again and
is the agent's, not the endpoint's), with an instant scripted sampler behind it (a tool call per turn,
routed-experts rows of a 4-layer
top-2 model), so the figure is the endpoint's overhead alone, not sampling. Each turn appends the
returned assistant message and a 200-character tool result (append-only: every request extends
the previous completion). Per round, every request's wall time is taken; a turn's figure is the
median over rounds of the mean of the 10 turns ending there (turns 1-10 for turn 1; then 100, 300). The ratio
turn 300 / turn 1 says whether the endpoint's work grows with the history (it canonicalises every
message of a request, O(history), but renders and tokenises only the new ones).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import time
import urllib.parse

import numpy as np

from t1async.models.tokenizer import ChatTokenizer
from t1async.rollout.endpoint import OpenAIEndpoint, SessionLimits
from t1async.sampling.sampler_client import SamplerResponse

LAYERS, TOP_K = 4, 2
BASH = {"type": "function", "function": {"name": "bash", "description": "run a command",
                                         "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}


class InstantSampler:
    """Answers every request at once with a bash tool call (exact shapes, constant ids)."""

    def __init__(self, tok: ChatTokenizer):
        self.turn = [*tok.render_tool_call("bash", {"command": "ls -la /app"}), tok.im_end_id]

    def generate(self, input_ids, sampling_params, *, routed_experts_start_len=0):
        rows = len(input_ids) + len(self.turn) - 1 - routed_experts_start_len
        return SamplerResponse(list(self.turn), [-0.5] * len(self.turn), np.zeros((rows, LAYERS, TOP_K), np.uint8),
                               "stop", 0)


def one_round(endpoint: OpenAIEndpoint, tok: ChatTokenizer, turns: int) -> tuple[list[float], int]:
    session = endpoint.open(InstantSampler(tok), lambda c: None,
                            SessionLimits({"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0, "top_k": -1},
                                          turns, 1 << 30))
    u = urllib.parse.urlsplit(endpoint.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    messages = [{"role": "system", "content": "You run commands."}, {"role": "user", "content": "Fix the build."}]
    times = []
    for i in range(turns):
        t0 = time.perf_counter()
        conn.request("POST", f"/s/{session.token}/v1/chat/completions", headers={"Content-Type": "application/json"},
                     body=json.dumps({"model": "t1async", "messages": messages, "tools": [BASH]}))
        resp = conn.getresponse()
        msg = json.loads(resp.read())["choices"][0]["message"]
        times.append(time.perf_counter() - t0)
        assert resp.status == 200, msg
        messages += [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"],
                           "content": f"output {i} " + "x" * 190}]
    conn.close()
    assert session.recorder.history_breaks == 0 and len(session.recorder.segments()) == 1
    tokens = len(session.recorder.records[-1].prompt_ids)
    endpoint.close_session(session)
    return times, tokens


# ---------------------------------------------------------------- --dialects

ROUTES = {"chat": "chat/completions", "responses": "responses", "messages": "messages"}


def _first(dialect: str, stream: bool) -> dict:
    """The first request of a session in ``dialect`` (a system prompt, the task, the bash tool)."""
    fn = BASH["function"]
    if dialect == "chat":
        return {"model": "m", "stream": stream, "tools": [BASH], "messages": [
            {"role": "system", "content": "You run commands."}, {"role": "user", "content": "Fix the build."}]}
    if dialect == "responses":
        return {"model": "m", "stream": stream, "instructions": "You run commands.", "input": [
            {"role": "user", "content": "Fix the build."}], "tools": [{"type": "function", **fn}]}
    return {"model": "m", "stream": stream, "max_tokens": 64, "system": "You run commands.",
            "messages": [{"role": "user", "content": "Fix the build."}],
            "tools": [{"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}]}


def _extend(dialect: str, body: dict, turn: int) -> None:
    """Append the turn's answer (InstantSampler's bash call) and a 200-character result, in ``dialect``'s shape."""
    cid, args, result = f"call_{turn}_0", {"command": "ls -la /app"}, f"output {turn} " + "x" * 190
    if dialect == "chat":
        body["messages"] += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": "bash", "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": cid, "content": result}]
    elif dialect == "responses":
        body["input"] += [{"type": "function_call", "call_id": cid, "name": "bash", "arguments": json.dumps(args)},
                          {"type": "function_call_output", "call_id": cid, "output": result}]
    else:
        body["messages"] += [{"role": "assistant", "content": [{"type": "tool_use", "id": cid, "name": "bash",
                                                                "input": args}]},
                             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": cid,
                                                          "content": result}]}]


_FIRST_DELTA = (b'"delta":{"content":"', b"response.output_text.delta", b"response.function_call_arguments.delta",
                b"content_block_delta", b'"arguments":"')


def _session_times(endpoint: OpenAIEndpoint, sampler, dialect: str, stream: bool, turns: int) -> list[tuple]:
    """One session's requests: per request (seconds to the answer's end, seconds to its first delta or None)."""
    session = endpoint.open(sampler, lambda c: None, SessionLimits(
        {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0, "top_k": -1}, turns, 1 << 30))
    u = urllib.parse.urlsplit(endpoint.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    body, out = _first(dialect, stream), []
    for i in range(turns):
        t0 = time.perf_counter()
        conn.request("POST", f"/s/{session.token}/v1/{ROUTES[dialect]}", json.dumps(body).encode(),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        first = None
        if stream:
            while line := resp.readline():
                if first is None and any(m in line for m in _FIRST_DELTA):
                    first = time.perf_counter() - t0
        else:
            resp.read()
        out.append((time.perf_counter() - t0, first))
        assert resp.status == 200, resp.status
        _extend(dialect, body, i)
    conn.close()
    assert session.recorder.history_breaks == 0, f"{dialect}: the bench's history broke"
    endpoint.close_session(session)
    return out


class DelayedSampler(InstantSampler):
    """InstantSampler that answers after ``delay_s`` (a sampler's own time to its whole turn)."""

    def __init__(self, tok: ChatTokenizer, delay_s: float):
        super().__init__(tok)
        self.delay_s = delay_s

    def generate(self, input_ids, sampling_params, *, routed_experts_start_len=0):
        time.sleep(self.delay_s)
        return super().generate(input_ids, sampling_params, routed_experts_start_len=routed_experts_start_len)


def _pct(values: list[float], q: float) -> float:
    return round(1000 * float(np.percentile(values, q)), 2)


def dialects(endpoint: OpenAIEndpoint, tok: ChatTokenizer, turns: int, sessions: list[int], delay_ms: float) -> dict:
    """Overhead of each dialect, streamed and not, at each number of concurrent sessions.

    Every session runs ``turns`` append-only requests (a bash call answered, a 200-character result
    sent back) on its own keep-alive connection, all sessions at once (threads). The sampler is
    InstantSampler, so a request's wall time is the endpoint's work (parse, render, record, answer,
    events) plus HTTP: ``overhead`` p50/p99 in ms = request wall time minus a direct sampler call's
    (measured alike, median). ``ttft``: one session with a sampler that takes ``delay_ms`` per turn
    (it answers whole turns, as SGLang's /generate without streaming): time to the first text or
    argument delta, against the sampler's own time to its answer (``delay_ms``).
    """
    import concurrent.futures

    sampler = InstantSampler(tok)
    direct = []
    for _ in range(200):
        t0 = time.perf_counter()
        sampler.generate(list(range(500)), {}, routed_experts_start_len=0)
        direct.append(time.perf_counter() - t0)
    base = statistics.median(direct)
    rows = {}
    for dialect in ROUTES:
        for stream in (False, True):
            for n in sessions:
                with concurrent.futures.ThreadPoolExecutor(n) as pool:
                    runs = list(pool.map(lambda _: _session_times(endpoint, sampler, dialect, stream, turns), range(n)))
                walls = [w - base for run in runs for w, _ in run]
                rows[f"{dialect}{'_stream' if stream else ''}_{n}_sessions"] = {
                    "overhead_p50_ms": _pct(walls, 50), "overhead_p99_ms": _pct(walls, 99), "requests": len(walls)}
    ttft = {}
    for dialect in ROUTES:
        run = _session_times(endpoint, DelayedSampler(tok, delay_ms / 1000), dialect, True, min(turns, 20))
        firsts = [f for _, f in run if f is not None]
        ttft[dialect] = {"first_delta_p50_ms": _pct(firsts, 50), "first_delta_p99_ms": _pct(firsts, 99),
                         "sampler_turn_ms": delay_ms}
    return {"direct_sampler_call_ms": round(1000 * base, 4), "overhead": rows, "ttft": ttft}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dialects", action="store_true", help="overhead per dialect, streamed and not (--turns per session)")
    ap.add_argument("--sessions", default="1,16", help="with --dialects: numbers of concurrent sessions")
    ap.add_argument("--delay-ms", type=float, default=50.0, help="with --dialects: the TTFT sampler's time per turn")
    args = ap.parse_args()
    tok = ChatTokenizer.load()
    if args.dialects:
        endpoint = OpenAIEndpoint(tok)
        try:
            out = dialects(endpoint, tok, args.turns, [int(x) for x in args.sessions.split(",")], args.delay_ms)
        finally:
            endpoint.shutdown()
        print(json.dumps({"turns_per_session": args.turns, **out}))
        return
    endpoint = OpenAIEndpoint(tok)
    try:
        rounds = [one_round(endpoint, tok, args.turns) for _ in range(args.rounds)]
    finally:
        endpoint.shutdown()
    at = sorted({1, min(100, args.turns), args.turns})
    ms = {f"turn_{t}_ms": round(statistics.median(1000 * statistics.mean(r[max(0, t - 10):t] if t > 1 else r[:10])
                                                  for r, _ in rounds), 2) for t in at}
    print(json.dumps({"turns": args.turns, "rounds": args.rounds, **ms,
                      "ratio_last_to_first": round(ms[f"turn_{at[-1]}_ms"] / ms["turn_1_ms"], 2),
                      "prompt_tokens_at_last_turn": rounds[0][1]}))


if __name__ == "__main__":
    main()
