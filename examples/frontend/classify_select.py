"""Classification with `select`: the model scores each label as a continuation (mean logprob per
token, in one batched request) instead of generating free text that might be no label at all.

    make serve            # in another terminal
    python examples/frontend/classify_select.py [--base-url http://127.0.0.1:30000]
"""

import argparse

import frontend as sgl

LABELS = ["positive", "negative", "neutral"]
REVIEWS = [
    "Absolutely wonderful, I would buy it again.",
    "It broke after two days. Waste of money.",
    "It arrived on Tuesday in a cardboard box.",
]


@sgl.function
def classify(s, review):
    s += sgl.user(f"Classify the sentiment of this review as positive, negative or neutral.\n\n{review}")
    s += sgl.assistant("Sentiment: " + sgl.select("label", choices=LABELS))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    args = p.parse_args()
    sgl.set_default_backend(sgl.RuntimeEndpoint(args.base_url))
    for review, state in zip(REVIEWS, classify.run_batch([{"review": r} for r in REVIEWS])):
        scores = state.get_meta_info("label")["normalized_prompt_logprobs"]
        detail = ", ".join(f"{label} {score:.2f}" for label, score in zip(LABELS, scores))
        print(f"{state['label']:9s} <- {review}  ({detail})")


if __name__ == "__main__":
    main()
