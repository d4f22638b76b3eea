"""Token layout of an agent transcript, shared by the episode runner, the agent SFT and
seq-KD, so that what a model is trained on is token for token what it later samples from.

A transcript is one token sequence:

    prompt      chat template of [system, user] with the generation prompt
    turn 0      the assistant's tokens, ending with EOS (<|im_end|>)         student-written
    obs 0       "\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n"   masked
    turn 1      ...

The observation text is whatever the tokenizer's chat template puts between the end of
an assistant turn and the next generation prompt, found by rendering with and without
the message (never hard-coded), and it is tokenized on its own: the transcript is
extended, never re-tokenized, so the ids the student sampled stay verbatim.
"""
from __future__ import annotations

from functools import lru_cache

_PROBE = "\x00probe\x00"


def _ids(enc) -> list[int]:
    """apply_chat_template(tokenize=True) returns a list or a BatchEncoding, by version."""
    if isinstance(enc, dict) or hasattr(enc, "keys"):
        enc = enc["input_ids"]
    return [int(x) for x in enc]


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template of `messages` (system, user, ...) with the generation prompt."""
    return _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def end_of_turn_id(tokenizer) -> int:
    """The token that closes an assistant turn (the chat template's and the sampler's EOS)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id: an assistant turn could never end")
    return int(eos[0] if isinstance(eos, list) else eos)


@lru_cache(maxsize=64)
def _observation_frame(tokenizer, role: str) -> tuple[str, str]:
    """(before, after): the template's text around an observation's content, starting right
    after the assistant's EOS token text and ending with the next generation prompt."""
    eos_text = tokenizer.convert_ids_to_tokens(end_of_turn_id(tokenizer))
    head = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    without = tokenizer.apply_chat_template(head, tokenize=False)
    with_obs = tokenizer.apply_chat_template(head + [{"role": role, "content": _PROBE}], tokenize=False,
                                             add_generation_prompt=True)
    if not with_obs.startswith(without):
        raise ValueError("the chat template renders earlier messages differently once a message is appended; "
                         "multi-turn transcripts need a template that only appends")
    cut = without.rfind("a" + eos_text)
    if cut < 0:
        raise ValueError(f"the chat template does not close an assistant turn with the EOS token {eos_text!r}")
    tail = without[cut + 1 + len(eos_text):] + with_obs[len(without):]
    before, _, after = tail.partition(_PROBE)
    return before, after


def observation_ids(tokenizer, role: str, content: str) -> list[int]:
    """Tokens appended after an assistant turn's EOS: the observation (a `tool` result or
    the next `user` message) and the next assistant generation prompt."""
    before, after = _observation_frame(tokenizer, role)
    return list(tokenizer.encode(before + content + after, add_special_tokens=False))


def assistant_ids(tokenizer, text: str) -> list[int]:
    """A written (not sampled) assistant turn: its text's tokens and EOS."""
    return list(tokenizer.encode(text, add_special_tokens=False)) + [end_of_turn_id(tokenizer)]


def encode_transcript(tokenizer, messages: list[dict], processor=None):
    """(prompt_ids, completion_ids, loss_mask) of a finished transcript: `messages` is the
    system/user head, then assistant turns, each followed by a tool/user observation (the
    last assistant turn may end the list). Only assistant tokens get loss_mask 1, and not
    those of a turn marked {"loss": False} (a scripted turn that is context, not a target:
    the imperfect first page a revise episode starts from).

    With `processor` (a vision-language model's core.vision.VisionProcessor) an observation
    whose content holds images is encoded as the episode runner does (`image_observation_ids`:
    pads expanded, masked) and the row gets a fourth item, its images' Vision (None without
    any), in pad order."""
    from core.vision import cat_vision

    k = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    prompt = prompt_ids(tokenizer, messages[:k])
    ids: list[int] = []
    mask: list[int] = []
    visions = []
    rest = messages[k:]
    for j, m in enumerate(rest):
        if m["role"] == "assistant":
            if j and rest[j - 1]["role"] == "assistant":
                raise ValueError("encode_transcript: two assistant turns in a row (no observation between)")
            t = assistant_ids(tokenizer, m["content"])
            mask += [0 if m.get("loss") is False else 1] * len(t)
        else:
            if j == 0 or rest[j - 1]["role"] != "assistant":
                raise ValueError(f"encode_transcript: a {m['role']!r} message must follow an assistant turn")
            if processor is not None and not isinstance(m["content"], str):
                t, v = image_observation_ids(tokenizer, processor, m["role"], m["content"])
                visions.append(v)
            else:
                t = observation_ids(tokenizer, m["role"], m["content"])
            if j == len(rest) - 1:
                raise ValueError("encode_transcript: a transcript ends with an assistant turn, not an observation")
            mask += [0] * len(t)
        ids += t
    return (prompt, ids, mask) if processor is None else (prompt, ids, mask, cat_vision(visions))


def encode_segments(tokenizer, messages: list[dict], apply_context=None, processor=None) -> list[tuple]:
    """Rows of a finished transcript as the episode runner would have sampled them under a
    context policy (`apply_context`: the harness's, messages -> what the model sees):
    while the model sees the whole transcript, one row (`encode_transcript`); each turn
    after the policy first rewrote it, a row of its own whose prompt is that turn's view.
    With `processor`, rows of four items, the last the row's images (`encode_transcript`)."""
    if apply_context is None:
        return [encode_transcript(tokenizer, messages, processor)]
    asst = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
    whole = [j for j in asst if apply_context(messages[:j]) == messages[:j]]
    rest = [j for j in asst if j not in whole]
    if rest and whole and rest[0] < whole[-1]:
        raise ValueError("encode_segments: the context policy rewrote a turn and later stopped rewriting")
    rows = []
    if whole:
        # up to the last turn seen whole (a trailing observation carries no loss)
        end = whole[-1] + 1 if rest or messages[-1]["role"] != "assistant" else len(messages)
        row = encode_transcript(tokenizer, messages[:end], processor)
        if any(row[2]):   # not when every turn in it is context ({"loss": False})
            rows.append(row)
    for j in rest:
        if messages[j].get("loss") is False:   # context, not a target: no row of its own
            continue
        c = assistant_ids(tokenizer, messages[j]["content"])
        if processor is None:
            rows.append((prompt_ids(tokenizer, apply_context(messages[:j])), c, [1] * len(c)))
        else:   # the view re-rendered with its images, as the episode runner does
            p, v = vision_prompt_ids(tokenizer, processor, apply_context(messages[:j]))
            rows.append((p, c, [1] * len(c), v))
    return rows


def _rendered_content(tokenizer, role: str, content: list) -> str:
    """The chat template's text of a list content (image and text items), found as the
    observation frame is: rendered once with it and once with a probe string."""
    head = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    with_list = tokenizer.apply_chat_template(head + [{"role": role, "content": content}], tokenize=False,
                                              add_generation_prompt=True)
    with_probe = tokenizer.apply_chat_template(head + [{"role": role, "content": _PROBE}], tokenize=False,
                                               add_generation_prompt=True)
    pre, _, suf = with_probe.partition(_PROBE)
    if not (with_list.startswith(pre) and with_list.endswith(suf)):
        raise ValueError("the chat template renders a list content's message differently around it")
    return with_list[len(pre):len(with_list) - len(suf)]


def image_observation_ids(tokenizer, processor, role: str, content: list):
    """(ids, Vision) of an observation whose content holds images (core.vision): the
    template's text with each image's pad token repeated once per merged patch, and the
    images' pixel values. `processor`: a core.vision.VisionProcessor."""
    from core.vision import image_paths

    vision = processor.images(image_paths(content))
    before, after = _observation_frame(tokenizer, role)
    text = processor.expand(before + _rendered_content(tokenizer, role, content) + after, vision)
    return list(tokenizer.encode(text, add_special_tokens=False)), vision


def vision_prompt_ids(tokenizer, processor, messages: list[dict]):
    """(ids, Vision or None) of `messages` with the generation prompt, images expanded
    (a context policy's re-rendered view of a transcript that holds image observations)."""
    from core.vision import image_paths

    paths = [p for m in messages for p in image_paths(m.get("content"))]
    if not paths:
        return prompt_ids(tokenizer, messages), None
    vision = processor.images(paths)
    text = processor.expand(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                            vision)
    return list(tokenizer.encode(text, add_special_tokens=False)), vision
