"""The reference for the gateway's tokenizer: chat requests rendered as Hugging Face's `apply_chat_template` renders
them (jinja2's sandboxed environment with trim_blocks, lstrip_blocks and loop controls, `raise_exception`,
`strftime_now`, a `tojson` filter, the special tokens as variables, add_generation_prompt=True) and tokenized
with the `tokenizers` package without special tokens; text prompts tokenized with them.

Usage: python3 tokenize_reference.py MODEL_DIR < cases.jsonl > ids.jsonl. Each case is {"messages": [...],
"tools": [...]?} or {"text": "..."}; each output line is the case's token ids as a JSON array, or
{"error": "..."} when the template refuses it.
"""
import json
import sys
from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

model = sys.argv[1]
tokenizer = Tokenizer.from_file(f"{model}/tokenizer.json")
config = json.load(open(f"{model}/tokenizer_config.json"))


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception
env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
template = env.from_string(config["chat_template"])
special = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}

for line in sys.stdin:
    case = json.loads(line)
    try:
        if "messages" in case:
            kwargs = dict(special)
            if case.get("tools") is not None:
                kwargs["tools"] = case["tools"]
            text = template.render(messages=case["messages"], add_generation_prompt=True, **kwargs)
            ids = tokenizer.encode(text, add_special_tokens=False).ids
        else:
            ids = tokenizer.encode(case["text"], add_special_tokens=True).ids
        print(json.dumps(ids))
    except Exception as e:  # the template refused the conversation
        print(json.dumps({"error": str(e)}))
