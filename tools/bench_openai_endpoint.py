"""Cost of the OpenAI-compatible endpoint itself: one completion's round trip at turns 1, 100 and 300.

Run: ``t1async bench openai-endpoint [--turns 300] [--rounds 3]``. Prints ONE JSON object.

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tok = ChatTokenizer.load()
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
