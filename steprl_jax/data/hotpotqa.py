"""HotPotQA in the IRCoT-style format of `shared/data/hotpotqa/`."""
from __future__ import annotations

import dataclasses
import os

from steprl_jax.data.jsonl import DataFormatError, LoadReport, load_records, require


@dataclasses.dataclass(frozen=True)
class Paragraph:
    title: str
    text: str
    is_supporting: bool


@dataclasses.dataclass(frozen=True)
class HotpotQAExample:
    id: str
    question: str
    answers: tuple[str, ...]
    paragraphs: tuple[Paragraph, ...]

    @property
    def supporting_titles(self) -> tuple[str, ...]:
        return tuple(p.title for p in self.paragraphs if p.is_supporting)


def parse_hotpotqa_record(record, where: str) -> HotpotQAExample:
    question = require(record, "question_text", str, where)
    answers: list[str] = []
    for i, obj in enumerate(require(record, "answers_objects", list, where)):
        spans = require(obj, "spans", list, f"{where}: answers_objects[{i}]")
        if not all(isinstance(s, str) for s in spans):
            raise DataFormatError(f"{where}: answers_objects[{i}].spans must be strings")
        answers.extend(spans)
    if not answers:
        raise DataFormatError(f"{where}: no answer spans")
    paragraphs = []
    for i, ctx in enumerate(require(record, "contexts", list, where)):
        at = f"{where}: contexts[{i}]"
        paragraphs.append(Paragraph(require(ctx, "title", str, at), require(ctx, "paragraph_text", str, at),
                                    bool(require(ctx, "is_supporting", bool, at))))
    qid = record.get("question_id", where)
    return HotpotQAExample(str(qid), question, tuple(answers), tuple(paragraphs))


def load_hotpotqa(path: str | os.PathLike, skip_malformed: bool = False,
                  report: LoadReport | None = None) -> list[HotpotQAExample]:
    return load_records(path, parse_hotpotqa_record, skip_malformed, report)
