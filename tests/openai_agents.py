"""Two chat agents taking turns through a dprouter gateway with the official `openai` package, streaming with
`include_usage` (as SDK users do: the SDK reads `[DONE]` and lets go of the connection).

Usage: python3 openai_agents.py BASE_URL TURNS   (e.g. http://127.0.0.1:8000/v1 4)
Prints one JSON line: the prompt and cached tokens summed over every usage report the client saw.
"""
import json
import sys

import openai

client = openai.OpenAI(base_url=sys.argv[1], api_key="unused")
turns = int(sys.argv[2])
histories = []
for agent in range(2):
    tools = "".join(f"- tool_{agent}_{i}: looks up record {i} of ledger {agent}.\n" for i in range(24))
    histories.append([{"role": "system", "content": f"You are agent {agent}. Your tools:\n{tools}"}])
prompt = cached = 0
for turn in range(turns):
    for agent, history in enumerate(histories):
        history.append({"role": "user", "content": f"Turn {turn}: what is {turn} plus {agent}?"})
        stream = client.chat.completions.create(
            model="smollm2", messages=history, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
        parts, usage = [], None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage:
                usage = chunk.usage
        assert usage is not None, "no usage report"
        history.append({"role": "assistant", "content": "".join(parts)})
        prompt += usage.prompt_tokens
        details = usage.prompt_tokens_details
        cached += (details.cached_tokens or 0) if details else 0
print(json.dumps({"prompt_tokens": prompt, "cached_tokens": cached}))
