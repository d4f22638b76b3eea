"""Reading model completions the way TRL hands them to rewards: plain strings or chat
message lists. Shared by every reward, the evals and SFT."""
from __future__ import annotations


def completion_text(completion) -> str:
    """The text of a completion given as a string or as chat messages (the last
    assistant message's content); anything else reads as empty."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        content = completion.get("content")
        return content if isinstance(content, str) else ""
    if isinstance(completion, (list, tuple)):
        for msg in reversed(completion):
            if isinstance(msg, dict) and msg.get("role", "assistant") == "assistant":
                content = msg.get("content")
                return content if isinstance(content, str) else ""
    return ""
