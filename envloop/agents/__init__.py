"""Agent programs as environments: an OpenAI-compatible endpoint in front of a policy that
records what the policy really saw and sampled, token for token, and a rollout API over
agent programs written against the OpenAI API (see docs/agents.md).

- :class:`AgentEndpoint`: the endpoint (``POST /v1/chat/completions``, ``GET /v1/models``)
  and its sessions, each recorded as trajectory segments.
- :func:`run_agent_rollouts`: ``await agent(base_url, datum)`` for every sample of a batch,
  each with its own session, scored by the sample's environment; returns the final batch
  and metrics the rollout engines return.
- :func:`segment_advantages`: GRPO advantages of that batch, grouped by sample (a sample
  whose agent rewrote its history has a row per segment).

Needs the ``agents`` extra (``pip install 'envloop[agents]'``: starlette, uvicorn, openai).
"""

try:
    from envloop.agents.endpoint import AgentEndpoint
except ModuleNotFoundError as error:  # pragma: no cover - depends on the installed extras
    if error.name not in ("starlette", "uvicorn"):
        raise
    raise ModuleNotFoundError(
        f"envloop.agents needs {error.name}, part of the 'agents' extra: "
        "pip install 'envloop[agents]'.",
        name=error.name,
    ) from error
from envloop.agents.advantages import segment_advantages
from envloop.agents.rollout import run_agent_rollouts
from envloop.agents.sessions import Segment, Session
from envloop.agents.tool_calls import TOOL_CALL_FORMATS, ToolCall, tool_call_parser

__all__ = [
    "TOOL_CALL_FORMATS",
    "AgentEndpoint",
    "Segment",
    "Session",
    "ToolCall",
    "run_agent_rollouts",
    "segment_advantages",
    "tool_call_parser",
]
