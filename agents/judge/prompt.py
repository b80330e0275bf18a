"""The judge's prompt: the task, the rubric, the shared prefix once, then each trajectory under a stable id.

Layout of the user message (plain text, tags so a judge can tell the parts apart)::

    <task> the agent's own system prompt (or an explicit task description) </task>
    <available_tools> one line per tool: name(params): description </available_tools>
    <shared_context> the messages every trajectory starts with, rendered once </shared_context>
    <trajectory id="t1"> what t1 did after the shared context, then its additional histories </trajectory>
    ...

Ids are ``t1..tN`` for trajectory indices ``0..N-1``; the answer is matched by id, never by position.
The shared prefix is the longest run of identical leading messages, capped so that every trajectory
keeps at least its last message (a group of identical trajectories still shows each one's answer).
Tool calls render as ``name({"arg": ...})`` and tool results under the tool's name, so the judge
reads what happened rather than raw JSON. Token ids and logprobs never enter the prompt.
"""

from __future__ import annotations

import json
from typing import Any

from agents.trajectory import Trajectory, TrajectoryGroup

PROMPT_VERSION = 1

DEFAULT_RUBRIC = """\
- A trajectory that achieves the task's goal scores much higher than one that does not.
- Between two that succeed, the one that gets there more efficiently (fewer steps, fewer wasted tool calls) scores higher.
- Score gaps should be proportional to quality gaps: near-identical work gets near-identical scores.
- Give partial credit for real progress toward the goal; a trajectory that makes things worse scores lowest.
- Judge what the agent did and said, not how confident it sounds; an unsupported claim of success is not success."""

SYSTEM_TEMPLATE = """\
You are a careful, impartial judge of an AI agent. You are shown {n} trajectories: independent attempts \
by the same agent at the same task, each under an id ({ids}). Compare them with each other and give each \
a score between 0 and 1 (1 = best possible) using the rubric below.

Rubric:
{rubric}

Answer with one JSON object and nothing else, in this form:
{{"scores": [{{"id": "t1", "explanation": "one or two sentences", "score": 0.0}}, ...]}}
Give exactly one entry per id ({ids}), each id once, each score a number from 0 to 1."""

NO_TASK = "(the agent had no system prompt; infer its goal from the conversation)"


def trajectory_ids(n: int) -> list[str]:
    """Stable ids ``t1..tN``; ``t<k>`` is trajectory index ``k-1``."""
    return [f"t{i + 1}" for i in range(n)]


def id_to_index(traj_id: str) -> int:
    return int(traj_id[1:]) - 1


def canonical_json(value: Any) -> str:
    """Order-independent JSON text (sorted keys, no spaces); non-JSON values fall back to ``str``."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def task_statement(group: TrajectoryGroup, task_description: str | None = None) -> str:
    """The explicit description if given, else the first system message of the first trajectory."""
    if task_description:
        return task_description.strip()
    for traj in group.trajectories:
        for msg in traj.messages():
            if msg.get("role") in ("system", "developer"):
                return content_text(msg.get("content")).strip() or NO_TASK
        break
    return NO_TASK


def content_text(content: Any) -> str:
    """Message content as text: strings as is; content parts joined (images named, not inlined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif isinstance(part, dict):
                parts.append(f"[{part.get('type', 'part')}]")
            else:
                parts.append(str(part))
        return "\n".join(parts)
    return str(content)


def _tool_call_text(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    name = fn.get("name") or call.get("name") or "?"
    args = fn.get("arguments", call.get("arguments", ""))
    if isinstance(args, str):
        try:
            args = canonical_json(json.loads(args)) if args.strip() else "{}"
        except ValueError:
            pass  # malformed arguments are shown as the model wrote them
    else:
        args = canonical_json(args)
    return f"{name}({args})"


def render_message(msg: dict[str, Any], tool_names: dict[str, str] | None = None) -> str:
    """One message as readable text: ``[role] content``; tool calls and results named."""
    role = msg.get("role", "?")
    text = content_text(msg.get("content")).strip()
    lines = []
    if role == "tool":
        call_id = msg.get("tool_call_id")
        name = msg.get("name") or (tool_names or {}).get(call_id or "", "")
        label = f"[tool result{(' ' + name) if name else ''}{(' #' + call_id) if call_id else ''}]"
        lines.append(f"{label} {text}" if text else f"{label} (empty)")
    else:
        if text or not msg.get("tool_calls"):
            lines.append(f"[{role}] {text}" if text else f"[{role}] (empty)")
        for call in msg.get("tool_calls") or []:
            cid = call.get("id")
            lines.append(f"[{role} calls tool{(' #' + cid) if cid else ''}] {_tool_call_text(call)}")
    return "\n".join(lines)


def render_messages(messages: list[dict[str, Any]], tool_names: dict[str, str] | None = None) -> str:
    return "\n".join(render_message(m, tool_names) for m in messages)


def _tool_names_by_call_id(messages: list[dict[str, Any]]) -> dict[str, str]:
    names = {}
    for m in messages:
        for call in m.get("tool_calls") or []:
            if call.get("id"):
                names[call["id"]] = (call.get("function") or {}).get("name") or call.get("name") or ""
    return names


def render_tool(tool: dict[str, Any]) -> str:
    """``- name(param: type, ...): description``; unfamiliar shapes fall back to compact JSON."""
    fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    name = fn.get("name")
    if not name:
        return f"- {canonical_json(tool)}"
    params = (fn.get("parameters") or {}).get("properties") or {}
    required = set((fn.get("parameters") or {}).get("required") or [])
    sig = ", ".join(
        f"{p}{'' if p in required else '?'}: {spec.get('type', 'any') if isinstance(spec, dict) else 'any'}"
        for p, spec in params.items()
    )
    desc = (fn.get("description") or "").strip()
    return f"- {name}({sig}){': ' + desc if desc else ''}"


def unique_tools(group: TrajectoryGroup) -> list[dict[str, Any]]:
    """Tools offered to the main conversations, deduplicated by content, in first-seen order."""
    seen, tools = set(), []
    for traj in group.trajectories:
        for tool in traj.tools or []:
            key = canonical_json(tool)
            if key not in seen:
                seen.add(key)
                tools.append(tool)
    return tools


def shared_prefix_length(conversations: list[list[dict[str, Any]]]) -> int:
    """Longest common message prefix, capped at ``min(len) - 1`` so every conversation keeps a message."""
    if not conversations:
        return 0
    keyed = [[canonical_json(m) for m in conv] for conv in conversations]
    limit = max(min(len(k) for k in keyed) - 1, 0)
    n = 0
    while n < limit and all(k[n] == keyed[0][n] for k in keyed):
        n += 1
    return n


def _render_trajectory(traj_id: str, traj: Trajectory, skip: int, main_tools: list[dict[str, Any]]) -> str:
    messages = traj.messages()
    names = _tool_names_by_call_id(messages)
    body = render_messages(messages[skip:], names) or "(no messages beyond the shared context)"
    parts = [f'<trajectory id="{traj_id}">', body]
    if traj.error:
        parts.append(f"[rollout error] {traj.error}")
    main_keys = {canonical_json(t) for t in main_tools}
    for k, history in enumerate(traj.additional_histories, start=1):
        hist_msgs = history.messages()
        parts.append(f'<additional_history n="{k}">')
        extra = [t for t in history.tools or [] if canonical_json(t) not in main_keys]
        if extra:
            parts.append("tools in this history:\n" + "\n".join(render_tool(t) for t in extra))
        parts.append(render_messages(hist_msgs, _tool_names_by_call_id(hist_msgs)) or "(empty)")
        parts.append("</additional_history>")
    parts.append("</trajectory>")
    return "\n".join(parts)


def _states(message: dict[str, Any], task: str) -> bool:
    return message.get("role") in ("system", "developer") and content_text(message.get("content")).strip() == task


def build_judge_messages(
    group: TrajectoryGroup, rubric: str, task_description: str | None = None
) -> tuple[list[dict[str, str]], list[str]]:
    """The chat messages to send the judge, and the trajectory ids they use (``t1..tN``)."""
    trajs = group.trajectories
    ids = trajectory_ids(len(trajs))
    conversations = [t.messages() for t in trajs]
    prefix_len = shared_prefix_length(conversations)
    task = task_statement(group, task_description)
    tools = unique_tools(group)

    prefix = conversations[0][:prefix_len] if trajs else []
    # A system prompt that is the task statement is not repeated in the shared context.
    if prefix and _states(prefix[0], task):
        prefix = prefix[1:]
    sections = [f"<task>\n{task}\n</task>"]
    if tools:
        sections.append("<available_tools>\n" + "\n".join(render_tool(t) for t in tools) + "\n</available_tools>")
    if prefix:
        sections.append(
            "<shared_context>\n" + render_messages(prefix, _tool_names_by_call_id(conversations[0])) + "\n</shared_context>"
        )
    for traj_id, traj, conv in zip(ids, trajs, conversations):
        # A trajectory whose system prompt was lifted into <task> shows the rest of its conversation.
        skip = 1 if prefix_len == 0 and conv and _states(conv[0], task) else prefix_len
        sections.append(_render_trajectory(traj_id, traj, skip, tools))
    system = SYSTEM_TEMPLATE.format(n=len(trajs), ids=", ".join(ids), rubric=rubric.strip())
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(sections)}], ids


def response_schema(ids: list[str]) -> dict[str, Any]:
    """``response_format`` asking for ``{"scores": [{"id", "explanation", "score"}]}`` with ids from ``ids``."""
    return {
        "type": "json_schema",
        "json_schema": {
            "name": "judge_scores",
            "strict": True,
            "schema": {
                "type": "object",
                "properties": {
                    "scores": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "id": {"type": "string", "enum": list(ids)},
                                "explanation": {"type": "string"},
                                "score": {"type": "number"},
                            },
                            "required": ["id", "explanation", "score"],
                            "additionalProperties": False,
                        },
                    }
                },
                "required": ["scores"],
                "additionalProperties": False,
            },
        },
    }
