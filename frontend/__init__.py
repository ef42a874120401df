"""The structured-program DSL: LLM programs in plain Python, run against a radixserve server
(`RuntimeEndpoint`) or an in-process `srt.Engine` (`EngineBackend`).

    import frontend as sgl

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

    sgl.set_default_backend(sgl.RuntimeEndpoint("http://127.0.0.1:30000"))
    print(qa.run(question="What is 2 + 2?")["answer"])
"""

from frontend.api import Program, function, get_default_backend, set_default_backend
from frontend.backends.base import Backend, BackendError
from frontend.backends.engine import EngineBackend
from frontend.backends.runtime_endpoint import RuntimeEndpoint
from frontend.choices import greedy_token_selection, token_length_normalized, unconditional_likelihood_normalized
from frontend.interpreter import ProgramError, ProgramState, ProgramStateGroup
from frontend.ir import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    image,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)

__all__ = [
    "Backend",
    "BackendError",
    "EngineBackend",
    "Program",
    "ProgramError",
    "ProgramState",
    "ProgramStateGroup",
    "RuntimeEndpoint",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_default_backend",
    "greedy_token_selection",
    "image",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
]
