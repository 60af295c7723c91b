"""`clawbridge.chat.content`: the one rule set for message content -> text, and its readers agreeing."""

from __future__ import annotations

from typing import Any

import pytest

from clawbridge.chat.content import TEXT_PART_TYPES, ContentError, content_text, loose_text
from clawbridge.openclaw.runtime_line import parse_runtime_session
from clawbridge.rewards.next_state import text_of

PARTS: list[Any] = [
    {"type": "text", "text": "a"},
    "b",
    {"type": "input_text", "text": "c"},
    {"type": "output_text", "text": "d"},
]


def test_text_parts_of_every_accepted_type_are_joined_with_newlines() -> None:
    assert {"text", "input_text", "output_text"} == TEXT_PART_TYPES
    assert content_text(PARTS) == "a\nb\nc\nd"
    assert content_text(None) == "" and content_text("x") == "x" and content_text([]) == ""
    # the loose reader of recorded data gives the same text for valid content
    for content in (PARTS, None, "x", []):
        assert loose_text(content) == content_text(content)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ([{"type": "image_url", "image_url": {"url": "x"}}], "content part type 'image_url' is not supported"),
        ([{"type": "text", "text": 3}], "text content part without a string 'text'"),
        ([3], "content parts must be objects"),
        ({"text": "x"}, "content must be a string, null or a list of text parts"),
    ],
)
def test_what_is_not_text_is_refused_naming_where(content: Any, message: str) -> None:
    with pytest.raises(ContentError, match=message) as info:
        content_text(content, "messages[2]")
    assert str(info.value).startswith("messages[2]: ")


def test_the_loose_reader_skips_what_is_not_text_and_never_raises() -> None:
    mixed = [{"type": "image_url", "image_url": {}}, {"type": "text", "text": "kept"}, 7,
             {"type": "tool_result", "content": [{"type": "text", "text": "nested"}]}]
    assert loose_text(mixed) == "kept\nnested"
    assert loose_text({"a": 1}) == '{"a": 1}'
    assert text_of is loose_text  # the judge reads recorded turns by the same rules


def test_the_runtime_line_is_read_from_any_text_part() -> None:
    line = "Runtime: agent=main | session=agent:main:explicit:s1 | sessionId=s1"
    msgs = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}, {"type": "text", "text": line}]}]
    assert parse_runtime_session(msgs) == "agent:main:explicit:s1"
    assert parse_runtime_session([{"role": "user", "content": None}]) is None


def test_an_adapter_reads_its_own_part_types_by_the_same_rules() -> None:
    from clawbridge.shapes.responses import RESPONSES_PART_FIELDS, input_messages

    parts = [{"type": "output_text", "text": "The answer "}, {"type": "refusal", "refusal": "is no."}]
    assert content_text(parts, fields=RESPONSES_PART_FIELDS, join="") == "The answer is no."
    with pytest.raises(ContentError) as info:
        content_text(parts)  # a refusal part is not chat-completions text
    assert info.value.index == 1 and info.value.field is None
    with pytest.raises(ContentError) as info:
        content_text([{"type": "text", "text": "a"}, {"type": "refusal"}], fields=RESPONSES_PART_FIELDS)
    assert (info.value.index, info.value.field) == (1, "refusal")
    # the Responses reader joins one message's parts as pieces of one text, summaries by paragraphs
    msgs = input_messages([
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "a"}, {"type": "summary_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "content": parts},
    ])
    assert msgs == [{"role": "assistant", "reasoning_content": "a\n\nb", "content": "The answer is no."}]
