"""The agent endpoint: OpenAI Chat Completions, OpenAI Responses and Anthropic Messages, streamed and
not, in front of a sampler, behind one recorder that keeps every completion token-exactly.

An agent program or a named harness (``rollout.agent``; t1async/rollout/endpoint/agent.py) drives an episode
through it the way it would talk to its usual API. One module per concern:

- recorder.py: the neutral conversation (Chat Completions messages), the exact prompt of each
  request (the previous completion extended, or a history break starting a new exact segment), the
  records (prompt ids, sampled ids, log-probs, routed experts, weight version);
- session.py: one episode's session: limits, settings checks, prepare/generate of a turn;
- chat.py, responses.py, messages.py: each dialect's request -> neutral request, turn -> answer,
  its server-sent events and its error shape;
- server.py: the FastAPI app and its routes.
"""

from t1async.rollout.endpoint.recorder import (
                                               ChatRecorder,
                                               CompletionRecord,
                                               RequestError,
                                               canonical,
                                               completion_message,
                                               template_completion_message,
                                               template_message,
                                               tool_specs,
)
from t1async.rollout.endpoint.server import DIALECTS, ENDPOINT_EXTRA, AgentEndpoint, OpenAIEndpoint
from t1async.rollout.endpoint.session import NeutralRequest, Session, SessionLimits, Turn

__all__ = ["AgentEndpoint", "ChatRecorder", "CompletionRecord", "DIALECTS", "ENDPOINT_EXTRA", "NeutralRequest",
           "OpenAIEndpoint", "RequestError", "Session", "SessionLimits", "Turn", "canonical", "completion_message",
           "template_completion_message", "template_message", "tool_specs"]
