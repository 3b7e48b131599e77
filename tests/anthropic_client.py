"""Agents through the gateway with Anthropic's official SDK: `python anthropic_client.py BASE_URL MODEL SESSIONS TURNS`.

Each session is one agent with Claude Code's session header: the program's system prompt and one tool shared by
every session, its own task, and each later turn the previous answer followed by a scripted `tool_use` and its
`tool_result` (a small model makes no real tool calls). Turns alternate between a streamed answer
(`messages.stream`) and a whole one (`messages.create`). Prints one JSON line per turn: the session, the turn, the
endpoint the gateway chose (`x-dprouter-endpoint`) and the answer's usage as the engine reported it.
"""

import json
import sys

import anthropic

base_url, model, sessions, turns = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
system = [{"type": "text", "text": "You are a coding agent working in a Rust repository. "
           + "Read the files you need before you change them, and keep answers short. " * 30,
           "cache_control": {"type": "ephemeral"}}]
tools = [{"name": "read_file", "description": "Reads a file of the repository",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
history = {s: [{"role": "user", "content": f"Task {s}: the test in module {s} fails. Find out why."}]
           for s in range(sessions)}
for turn in range(turns):
    for s in range(sessions):
        headers = {"x-claude-code-session-id": f"session-{s}"}
        args = dict(model=model, max_tokens=4, system=system, tools=tools, messages=history[s],
                    extra_headers=headers)
        if (s + turn) % 2 == 0:
            with client.messages.stream(**args) as stream:
                endpoint = stream.response.headers.get("x-dprouter-endpoint")
                message = stream.get_final_message()
        else:
            raw = client.messages.with_raw_response.create(**args)
            endpoint = raw.headers.get("x-dprouter-endpoint")
            message = raw.parse()
        usage = message.usage
        print(json.dumps({
            "session": s, "turn": turn, "endpoint": endpoint, "stop_reason": message.stop_reason,
            "input_tokens": usage.input_tokens,
            "cache_read_input_tokens": usage.cache_read_input_tokens or 0,
            "cache_creation_input_tokens": usage.cache_creation_input_tokens or 0,
        }), flush=True)
        text = "".join(block.text for block in message.content if block.type == "text") or "Let me look."
        call = f"toolu_{s}_{turn}"
        history[s].append({"role": "assistant", "content": [
            {"type": "text", "text": text},
            {"type": "tool_use", "id": call, "name": "read_file", "input": {"path": f"src/m{s}/f{turn}.rs"}},
        ]})
        history[s].append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call,
             "content": f"pub fn f{turn}() -> u32 {{ {turn} }} // " + "and more code " * 10},
        ]})
