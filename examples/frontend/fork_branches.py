"""Parallel branches with `fork`: expand one plan into several tips at once, then join them.

    make serve            # in another terminal
    python examples/frontend/fork_branches.py [--base-url http://127.0.0.1:30000] [--topic sleep]

`fork` first prefills the shared conversation (a `max_new_tokens: 0` request), so the branches'
requests, which run concurrently and are batched by the server, all reuse its KV cache.
"""

import argparse

import frontend as sgl

ASPECTS = ["diet", "exercise", "routine"]


@sgl.function
def tips(s, topic):
    s += sgl.system("You are a helpful coach. Keep every answer to one sentence.")
    s += sgl.user(f"I want to improve my {topic}. Give me advice.")
    forks = s.fork(len(ASPECTS))
    for f, aspect in zip(forks, ASPECTS):
        f += sgl.user(f"One tip about {aspect}.")
        f += sgl.assistant(sgl.gen("tip", max_tokens=40))
    forks.join()
    s += sgl.assistant("Here is my advice:\n" + "\n".join(f"- {a}: {t.strip()}" for a, t in zip(ASPECTS, s["tip"])))
    return [f.get_meta_info("tip")["cached_tokens"] for f in forks]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--topic", default="sleep")
    args = p.parse_args()
    sgl.set_default_backend(sgl.RuntimeEndpoint(args.base_url))
    state = tips.run(topic=args.topic, temperature=0.7)
    print(state.messages()[-1]["content"])
    print(f"\nprompt tokens served from the cache, per branch: {state.ret_value}")


if __name__ == "__main__":
    main()
