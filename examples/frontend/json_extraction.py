"""JSON extraction with `json_schema`: the output is constrained to the schema by the server's
grammar backend, so it always parses.

    make serve            # in another terminal
    python examples/frontend/json_extraction.py [--base-url http://127.0.0.1:30000]
"""

import argparse
import json

import frontend as sgl

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
    },
    "required": ["name", "city", "age"],
    "additionalProperties": False,
}
TEXTS = [
    "Maria is a 34-year-old architect who lives in Lisbon.",
    "Born 61 years ago, Kenji still runs his noodle shop in Osaka.",
    "Tom (age 8) goes to school in Leeds.",
]


@sgl.function
def extract(s, text):
    s += sgl.system("Extract the person's name, city and age as JSON.")
    s += sgl.user(text)
    s += sgl.assistant(sgl.gen("person", max_tokens=64, json_schema=SCHEMA))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    args = p.parse_args()
    sgl.set_default_backend(sgl.RuntimeEndpoint(args.base_url))
    for text, state in zip(TEXTS, extract.run_batch([{"text": t} for t in TEXTS], temperature=0)):
        print(f"{text}\n  -> {json.loads(state['person'])}")


if __name__ == "__main__":
    main()
