"""Tools, structured output and streamed parts with edgelm's runtime (docs/apps.md), on any chat package.

    python examples/apps.py PACKAGE
    python examples/apps.py PACKAGE --template tests/data/templates/Qwen-Qwen2.5-7B-Instruct.jinja

A package whose own template has no tools (SmolLM2's) can borrow a tool-use template with --template: the tool
call is then forced with tool_choice, so even a model never trained on tools answers in the template's format.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from edgelm.runtime import load


def get_weather(city: str) -> str:
    """The current weather in a city.

    Args:
        city: The city's name.
    """
    return json.dumps({"city": city, "weather": "sunny", "celsius": 21})


CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "maxLength": 30},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "country", "capital"],
    "additionalProperties": False,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package")
    parser.add_argument("--template", default=None, help="a chat template file to use instead of the package's")
    args = parser.parse_args()
    model = load(args.package)
    template = Path(args.template).read_text() if args.template else None

    # 1. JSON that matches a schema
    question = [{"role": "user", "content": "Describe Paris: its country and whether it is a capital."}]
    answer = model.chat(question, 80, template=template, response_format={"type": "json_schema", "json_schema": {
        "name": "city", "schema": CITY}})  # fmt: skip
    print("JSON answer:", json.loads(answer.content))

    # 2. a tool call, its result, and the reply that uses it
    conv = model.conversation(template=template, tools=[get_weather])
    if conv.convention.name == "plain":
        print("(this template writes no tool calls: pass --template with a tool-use template)")
        return
    asked = conv.send("What is the weather in Paris?", 60, tool_choice="required")
    for call in asked.tool_calls:
        print(f"tool call: {call.name}({call.arguments})")
        result = get_weather(**call.arguments)
        reply = conv.send({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": result}, 60)
        print("reply:", reply.content)

    # 3. a stream whose pieces say what they add: content, reasoning, tool calls
    stream = model.chat_stream([{"role": "user", "content": "Say hello."}], 30, template=template)
    for piece in stream:
        print(piece.content, end="", flush=True)
    print(f"\n[{stream.result.finish_reason}, reasoning: {stream.result.reasoning!r}]")


if __name__ == "__main__":
    main()
