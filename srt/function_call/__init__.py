"""Tool calls in model output (`--tool-call-parser`): one detector per format, each parsing complete
text and streaming; see `parser.py` for the registry and the constraints."""

from srt.function_call.core import ToolCallItem, ToolCallStream
from srt.function_call.parser import TOOL_CALL_PARSERS, FunctionCallParser, ToolError, check_tool_choice, check_tools

__all__ = [
    "TOOL_CALL_PARSERS",
    "FunctionCallParser",
    "ToolCallItem",
    "ToolCallStream",
    "ToolError",
    "check_tool_choice",
    "check_tools",
]
