"""A DSL program on an in-process `srt.Engine`: no server, no HTTP.

    python examples/frontend/engine_backend.py [--model-path PATH] [--dtype auto]

The Engine starts the scheduler and detokenizer processes itself (so the program must run under
`if __name__ == "__main__":`), and the program streams its text as it is generated.
"""

import argparse

import frontend as sgl


@sgl.function
def interview(s, name):
    s += sgl.system("You are a friendly interviewer. Keep questions short.")
    s += sgl.user(f"Hi, I'm {name}.")
    s += sgl.assistant(sgl.gen("greeting", max_tokens=32))
    s += sgl.user("Ask me one question about my work.")
    s += sgl.assistant(sgl.gen("question", max_tokens=32))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    backend = sgl.EngineBackend(
        model_path=args.model_path, dtype=args.dtype, max_total_tokens=16384, log_level="warning"
    )
    try:
        state = interview.run(name="Ada", temperature=0, stream=True, backend=backend)
        for piece in state.text_iter():
            print(piece, end="", flush=True)
        print(f"\n\nmessages: {[m['role'] for m in state.messages()]}")
    finally:
        backend.shutdown()


if __name__ == "__main__":
    main()
