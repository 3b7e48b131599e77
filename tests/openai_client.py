"""Drives a dprouter gateway with the official `openai` package: chat, streaming and not, completions, Responses,
streaming and not, embeddings and the model list.

Usage: python3 openai_client.py BASE_URL   (e.g. http://127.0.0.1:8000/v1); exits non-zero on any failure.
"""
import sys

import openai

client = openai.OpenAI(base_url=sys.argv[1], api_key="unused")
messages = [{"role": "system", "content": "You are terse. " * 100}, {"role": "user", "content": "Hello!"}]

whole = client.chat.completions.create(model="dprouter/mock", messages=messages, max_tokens=6)
text = whole.choices[0].message.content
assert text and len(text.split()) == 6, whole
assert whole.usage.prompt_tokens > 0, whole.usage

stream = client.chat.completions.create(
    model="dprouter/mock", messages=messages, max_tokens=6, stream=True, stream_options={"include_usage": True}
)
parts, usage = [], None
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        parts.append(chunk.choices[0].delta.content)
    if chunk.usage:
        usage = chunk.usage
assert "".join(parts) == text, (parts, text)
assert usage is not None and usage.prompt_tokens_details.cached_tokens > 0, usage

completion = client.completions.create(model="dprouter/mock", prompt="Once upon a time", max_tokens=3)
assert len(completion.choices[0].text.split()) == 3, completion

instructions = "You answer in one line. " * 100
response = client.responses.create(model="dprouter/mock", instructions=instructions, input="Hi!", max_output_tokens=4)
assert len(response.output_text.split()) == 4, response
assert response.usage.input_tokens > 0, response.usage
events = list(
    client.responses.create(
        model="dprouter/mock", instructions=instructions, input="Hi!", max_output_tokens=4, stream=True
    )
)
deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
assert deltas == response.output_text, (deltas, response.output_text)
final = events[-1].response
assert final.usage.input_tokens == response.usage.input_tokens, final.usage
assert final.usage.input_tokens_details.cached_tokens > 0, final.usage
follow_up = client.responses.create(
    model="dprouter/mock", input="And then?", previous_response_id=final.id, max_output_tokens=2
)
assert follow_up.usage.input_tokens > final.usage.input_tokens, follow_up.usage
assert client.responses.retrieve(follow_up.id).id == follow_up.id
client.responses.delete(follow_up.id)

embeddings = client.embeddings.create(model="dprouter/mock", input=["first text", "second text"])
assert [e.index for e in embeddings.data] == [0, 1], embeddings
assert len(embeddings.data[0].embedding) == 8 and embeddings.data[0].embedding != embeddings.data[1].embedding
assert embeddings.usage.prompt_tokens > 0, embeddings.usage

models = client.models.list()
assert models.data[0].id == "dprouter/mock", models
print("openai client ok:", text)
