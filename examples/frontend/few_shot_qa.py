"""Few-shot question answering: a fixed prefix of examples, a stop string, a batch of questions.

    make serve            # in another terminal
    python examples/frontend/few_shot_qa.py [--base-url http://127.0.0.1:30000]

Every question shares the few-shot prefix, so after the first one the server serves it from its
radix cache: the `cached_tokens` column shows it.
"""

import argparse

import frontend as sgl

QUESTIONS = [
    "What is the capital of Germany?",
    "What is the largest planet?",
    "How many days are in a week?",
    "What color is the sky on a clear day?",
]


@sgl.function
def few_shot_qa(s, question):
    s += "Answer each question in a few words.\n\n"
    s += "Q: What is the capital of Italy?\nA: Rome\n\n"
    s += "Q: How many legs does a spider have?\nA: Eight\n\n"
    s += "Q: What is the boiling point of water at sea level?\nA: 100 degrees Celsius\n\n"
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=16, stop="\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--api-key", default=None)
    args = p.parse_args()
    sgl.set_default_backend(sgl.RuntimeEndpoint(args.base_url, api_key=args.api_key))
    states = few_shot_qa.run_batch([{"question": q} for q in QUESTIONS], temperature=0)
    for q, s in zip(QUESTIONS, states):
        meta = s.get_meta_info("answer")
        print(f"{q:45s} -> {s['answer'].strip()!r:32s} cached_tokens={meta['cached_tokens']}")


if __name__ == "__main__":
    main()
